"""torch's global settings that traced code may read or that choose its kernels: read
(:func:`torch_settings`: the prologue compares them, and a checked layer at each call), and
put back where the traced code left one changed (:func:`put_settings_back`)."""

from __future__ import annotations

import torch

from ..core import TracingError


def torch_settings() -> tuple:
    """torch's global settings that the traced code may read (``if
    torch.are_deterministic_algorithms_enabled():``) or that choose its kernels: read
    while tracing, they are baked into the program, so the prologue compares them (and a
    checked layer at each call: ``verified.py``). Read from torch's own getters, bound once,
    where ``torch.backends``' modules would look each up by name (about 1.5 us in all): the
    kernels' settings first (:func:`kernel_settings`), then those only code reads."""
    C = torch._C
    return (
        *kernel_settings(),
        C.is_anomaly_enabled(),
        C.is_anomaly_check_nan_enabled(),
        C._get_warnAlways(),
        C.get_autocast_dtype("cpu"),
        C.get_autocast_dtype("cuda"),
        _mha_fastpath(),
        C._get_qengine(),  # (``torch.backends.quantized.engine``, as torch's enum)
        *_opt_einsum(),
        _Distribution._validate_args,  # (``set_default_validate_args``: whether distributions check arguments)
        autocast_cache_seen(),
    )


_Distribution = torch.distributions.Distribution


_mha_fastpath = torch.backends.mha.get_fastpath_enabled


def sdpa_backends() -> tuple:
    """Which attention kernels ``scaled_dot_product_attention`` may pick, in which order, and
    whether its math kernel may reduce in half precision (``sdpa_kernel``, ``torch.backends.cuda``
    set them): the op it records, or what it computes where recorded whole, depends on them."""
    values = [get() for get in _SDPA_GETTERS]
    if _SDPA_ORDER is not None:
        values[_SDPA_ORDER] = tuple(values[_SDPA_ORDER])  # (a list)
    return tuple(values)


# torch's getter and setter of each attention flag (fa3's since torch 2.11).
_SDPA_FLAGS = [
    (f"_get_{name}", f"_set_{setter}")
    for name, setter in (
        ("flash_sdp_enabled", "sdp_use_flash"),
        ("mem_efficient_sdp_enabled", "sdp_use_mem_efficient"),
        ("math_sdp_enabled", "sdp_use_math"),
        ("cudnn_sdp_enabled", "sdp_use_cudnn"),
        ("overrideable_sdp_enabled", "sdp_use_overrideable"),
        ("fa3_sdp_enabled", "sdp_use_fa3"),
        ("math_sdp_allow_fp16_bf16_reduction", "math_sdp_allow_fp16_bf16_reduction"),
        ("sdp_priority_order", "sdp_priority_order"),
    )
    if hasattr(torch._C, f"_get_{name}")
]
_SDPA_GETTERS = [getattr(torch._C, getter) for getter, _ in _SDPA_FLAGS]
_SDPA_ORDER = next((i for i, (getter, _) in enumerate(_SDPA_FLAGS) if getter == "_get_sdp_priority_order"), None)


def _opt_einsum() -> tuple:
    """``torch.backends.opt_einsum``'s ``enabled`` and ``strategy``. Its module object looks
    both up through a failed attribute lookup (1.4 us each): one set on it is in its own
    dict, else the module it wraps has them."""
    flags = torch.backends.opt_einsum
    own, wrapped = vars(flags), getattr(flags, "m", flags)
    return (
        own["enabled"] if "enabled" in own else wrapped.enabled,
        own["strategy"] if "strategy" in own else wrapped.strategy,
    )


# torch's per-backend float32 precisions (``torch.backends.mkldnn.matmul.fp32_precision``).
_PRECISION_BACKENDS = ("", "cuda.matmul", "mkldnn.matmul", "mkldnn.conv", "mkldnn.rnn", "cudnn.conv", "cudnn.rnn")


def _backend(path: str):
    found = torch.backends
    for part in filter(None, path.split(".")):
        found = getattr(found, part)
    return found


def _matmul_precision(per_backend: bool = False) -> str | tuple:
    """The float32 matmul precision: torch's summary, or, where torch refuses to give
    one (a backend's own precision set apart from it) or ``per_backend``, each backend's."""
    try:
        if not per_backend:
            return torch.get_float32_matmul_precision()
    except RuntimeError:
        pass
    return tuple(getattr(_backend(path), "fp32_precision", None) for path in _PRECISION_BACKENDS)


def _allow_tf32(getter) -> bool | None:
    """cuDNN's or cuBLAS's ``allow_tf32``; None where torch refuses to read it, once a
    precision was set by its newer API (``torch.backends.fp32_precision = "tf32"``): each
    backend's precision then says it."""
    try:
        return getter()
    except RuntimeError:
        return None


def _set_matmul_precision(precision: str | tuple) -> None:
    if isinstance(precision, str):
        torch.set_float32_matmul_precision(precision)
        return
    for path, value in zip(_PRECISION_BACKENDS, precision):
        if value is not None:
            _backend(path).fp32_precision = value


def put_settings_back(settings: tuple) -> None:
    """Set what :func:`torch_settings` reads back to ``settings``."""
    (deterministic, warn_only, fill, precision, threads, mkldnn, mkldnn_deterministic, *cudnn) = settings[:11]
    tf32, fp16, bf16, sdpa = settings[11:15]
    (anomaly, check_nan, warn_always, cpu_dtype, cuda_dtype, fastpath, quantized, *opt_einsum) = settings[15:-2]
    validate_args, autocast_cache = settings[-2:]
    backends, matmul = torch.backends, torch.backends.cuda.matmul
    torch.use_deterministic_algorithms(deterministic, warn_only=warn_only)
    torch.utils.deterministic.fill_uninitialized_memory = fill
    _set_matmul_precision(precision)
    torch.set_num_threads(threads)
    backends.mkldnn.enabled = mkldnn
    if mkldnn_deterministic is not None:
        backends.mkldnn.deterministic = mkldnn_deterministic
    for name, value in zip(("enabled", "deterministic", "benchmark", "allow_tf32"), cudnn):
        if value is not None:  # (allow_tf32 unread: the precisions above put it back)
            setattr(backends.cudnn, name, value)
    if tf32 is not None:
        matmul.allow_tf32 = tf32
    matmul.allow_fp16_reduced_precision_reduction = fp16
    matmul.allow_bf16_reduced_precision_reduction = bf16
    for (_, setter), value in zip(_SDPA_FLAGS, sdpa):
        getattr(torch._C, setter)(list(value) if type(value) is tuple else value)
    torch.autograd.set_detect_anomaly(anomaly, check_nan)
    torch.set_warn_always(warn_always)
    torch.set_autocast_dtype("cpu", cpu_dtype)
    torch.set_autocast_dtype("cuda", cuda_dtype)
    backends.mha.set_fastpath_enabled(fastpath)
    torch._C._set_qengine(quantized)
    backends.opt_einsum.enabled, backends.opt_einsum.strategy = opt_einsum
    _Distribution.set_default_validate_args(validate_args)
    if outer_autocast_cache:  # while tracing (``autocast_cache_off``)
        outer_autocast_cache[-1] = autocast_cache
    else:
        torch._C.set_autocast_cache_enabled(autocast_cache)


outer_autocast_cache: list[bool] = []  # while tracing: what the caller's code sees of the flag


def autocast_cache_seen() -> bool:
    return outer_autocast_cache[-1] if outer_autocast_cache else torch._C.is_autocast_cache_enabled()


def set_autocast_cache_seen(enabled: bool) -> None:
    outer_autocast_cache[-1] = enabled


def kernel_settings() -> tuple:
    """The settings kernels read when they run, not when tracing records them: a program's
    ops run under the caller's (deterministic algorithms, float32 matmul precision, threads,
    mkldnn's and cudnn's flags, cuBLAS's reductions); last, the attention flags, which only
    an attention recorded whole reads then (under inference mode: ``kernel_settings_differ``)."""
    C = torch._C
    cudnn_tf32, cublas_tf32 = _allow_tf32(C._get_cudnn_allow_tf32), _allow_tf32(C._get_cublas_allow_tf32)
    return (
        C._get_deterministic_algorithms(),
        C._get_deterministic_algorithms_warn_only(),
        C._get_deterministic_fill_uninitialized_memory(),
        _matmul_precision(per_backend=cudnn_tf32 is None or cublas_tf32 is None),
        torch.get_num_threads(),
        C._get_mkldnn_enabled(),
        C._get_mkldnn_deterministic(),
        C._get_cudnn_enabled(),
        C._get_cudnn_deterministic(),
        C._get_cudnn_benchmark(),
        cudnn_tf32,
        cublas_tf32,
        C._get_cublas_allow_fp16_reduced_precision_reduction()[0],
        C._get_cublas_allow_bf16_reduced_precision_reduction()[0],
        sdpa_backends(),
    )


def kernel_settings_differ(func, before: tuple) -> bool:
    """Whether ``func`` would run under kernel settings other than ``before`` (the call's)."""
    now = kernel_settings()
    return now[:-1] != before[:-1] or (func is _WHOLE_ATTENTION and now[-1] != before[-1])


_WHOLE_ATTENTION = torch.ops.aten.scaled_dot_product_attention.default  # (it picks its kernel when it runs)


def kernel_settings_changed(call, before: tuple) -> TracingError:
    """The error for an op the traced code ran under kernel settings it changed (and may
    put back before the call returns)."""
    names = ("deterministic algorithms", "their warn_only", "their fill of uninitialized memory")
    names += ("the float32 matmul precision", "the number of threads", "mkldnn's enabled flag")
    names += ("mkldnn's deterministic flag", "cudnn's enabled flag", "cudnn's deterministic flag")
    names += ("cudnn's benchmark flag", "cudnn's allow_tf32", "cuBLAS's allow_tf32", "cuBLAS's fp16 reduction")
    names += ("cuBLAS's bf16 reduction", "the attention kernels allowed")
    changed = [n for n, a, b in zip(names, before, kernel_settings()) if a != b]
    return TracingError(
        f"dtcompile.jit: {call} ran under torch's settings the traced code changed ({', '.join(changed)}). Its "
        "kernel reads them when it runs, and the compiled program runs every op under the call's own settings, "
        "even where the code puts them back before returning. Set them before the call"
    )
