"""Runtime helpers the generated prologues call when a fast identity check fails."""

from __future__ import annotations

_group_names: dict[int, tuple[object, tuple[str, ...]]] = {}


def mesh_group_names(mesh) -> tuple[str, ...]:
    """The process-group name of each mesh dim (cached per mesh object)."""
    cached = _group_names.get(id(mesh))
    if cached is None or cached[0] is not mesh:
        cached = (mesh, tuple(mesh.get_group(d).group_name for d in range(mesh.ndim)))
        _group_names[id(mesh)] = cached
    return cached[1]


def meshes_match(mesh, expected) -> bool:
    """Same devices, layout and dim names (DeviceMesh's structural ``==``) and the same
    process groups, which the compiled program calls."""
    return mesh is expected or (mesh == expected and mesh_group_names(mesh) == mesh_group_names(expected))


def spec_matches(spec, expected) -> bool:
    """Same mesh, placements, shard order and global shape, stride and dtype."""
    return spec == expected and meshes_match(spec.mesh, expected.mesh)
