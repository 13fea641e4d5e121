"""Runtime helpers the generated prologues call when a fast identity check fails, the error
of a guard no prologue can make, and a prologue's lines that count a call's DTensor writes."""

from __future__ import annotations

from torch.autograd.graph import increment_version

from ..core import TracingError


def mesh_group_names(mesh) -> tuple[str, ...]:
    """The process-group name of each mesh dim (kept on the mesh: asked at every call
    that passes an equal mesh object other than the traced one)."""
    names = getattr(mesh, "_dtcompile_group_names", None)
    if names is None:
        names = tuple(mesh.get_group(d).group_name for d in range(mesh.ndim))
        mesh._dtcompile_group_names = names
    return names


def meshes_match(mesh, expected) -> bool:
    """Same devices, layout and dim names (DeviceMesh's structural ``==``) and the same
    process groups, which the compiled program calls."""
    return mesh is expected or (mesh == expected and mesh_group_names(mesh) == mesh_group_names(expected))


def spec_matches(spec, expected) -> bool:
    """Same mesh, placements, shard order and global shape, stride and dtype."""
    return spec == expected and meshes_match(spec.mesh, expected.mesh)


def unbound_sizes(symbols) -> TracingError:
    """The refusal of a guard on sizes that uses ``symbols`` no input's size binds."""
    return TracingError(
        f"dtcompile.jit: a guard on sizes uses {', '.join(sorted(map(str, symbols)))}, which no input's size binds: "
        "tensors of the call share memory in a way symbolic sizes do not describe (an argument that views a "
        "tensor the module holds, say). Pass a copy (.clone()), or use cache='constant values'"
    )


def writes_counted(b, dtensor_writes) -> None:
    """The prologue's last lines, once the call is accepted: each DTensor the call writes in
    place (``Proxifier.written_dtensors``: a node, or a closed-over DTensor's index) gets
    the writes DTensor counts on its version, which the program's writes to the local do not."""
    for written, count in dtensor_writes:
        var = f"CAPTURED{written}" if isinstance(written, int) else b.tensor_vars[id(written)]
        b.globals["count_writes"] = count_writes
        b.lines.append(f"    count_writes({var}, {count})")


def count_writes(tensor, count: int) -> None:
    if not tensor.is_inference():  # (an inference tensor counts none)
        for _ in range(count):
            increment_version(tensor)
