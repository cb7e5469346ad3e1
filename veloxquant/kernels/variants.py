"""Every custom kernel goes through `kernel(...)` here: one place that knows which compiled
variants a process has asked for.

MLX compiles a `mx.fast.cuda_kernel` variant (its name, text and template arguments) with
NVRTC at the first evaluation that uses it; a decode step that meets a new variant stalls
for that build (docs/kernels.md, "Warm-up"). `recording()` collects the variants launches
ask for, so a test can check that a warm-up (runtime/warmup.py) asked for every variant a
later decode step does; `stand_in` lets that run on a machine without CUDA, with every
launch answered by zeros of its output shapes (graph only, no numbers).
"""

import contextlib
from typing import Callable, List, Optional, Set

import mlx.core as mx

from .source import prune, squeeze

_RECORDERS: List[Set[tuple]] = []


class _Stand:
    run: Optional[Callable] = None  # (inputs, output_shapes, output_dtypes) -> outputs, set by stand_in


def _template_key(template) -> tuple:
    return tuple((n, str(v)) for n, v in template or ())


class Kernel:
    """A custom kernel, built by `mx.fast.cuda_kernel` at its first launch (a CPU build of
    MLX cannot build one). Called as the MLX object is: `k(inputs=..., template=..., ...)`."""

    __slots__ = ("spec", "built")

    def __init__(self, **spec):
        # MLX rebuilds and hashes the whole text at every launch: only what this kernel
        # uses, without the spaces the compiler does not need (nvcc_check: same PTX).
        spec["source"] = squeeze(spec.get("source", ""))
        if spec.get("header"):
            spec["header"] = squeeze(prune(spec["header"], spec["source"]))
        self.spec, self.built = spec, None

    @property
    def text_bytes(self) -> int:
        """Bytes of kernel text (header and body) MLX rebuilds and hashes at each launch."""
        return len(self.spec.get("header", "")) + len(self.spec.get("source", ""))

    @property
    def name(self) -> str:
        return self.spec["name"]

    def __call__(self, inputs, output_shapes, output_dtypes, template=None, **kw):
        if _RECORDERS:
            key = (self.name, _template_key(template), tuple(str(a.dtype) for a in inputs))
            for seen in _RECORDERS:
                seen.add(key)
        if _Stand.run is not None:
            return _Stand.run(inputs, output_shapes, output_dtypes)
        if self.built is None:
            self.built = mx.fast.cuda_kernel(**self.spec)
        if template is not None:
            kw["template"] = template
        return self.built(inputs=inputs, output_shapes=output_shapes, output_dtypes=output_dtypes, **kw)


def kernel(**spec) -> Kernel:
    """`mx.fast.cuda_kernel(**spec)`, built at the first launch (see Kernel)."""
    return Kernel(**spec)


@contextlib.contextmanager
def recording():
    """The set of (kernel name, template) variants launched inside the block."""
    seen: Set[tuple] = set()
    _RECORDERS.append(seen)
    try:
        yield seen
    finally:
        _RECORDERS.remove(seen)


def _zeros(inputs, output_shapes, output_dtypes):
    # Depends keeps the inputs' producers in the graph, as a launch does.
    return mx.depends([mx.zeros(s, d) for s, d in zip(output_shapes, output_dtypes)], list(inputs))


@contextlib.contextmanager
def stand_in(run: Callable = _zeros):
    """Answer every launch inside the block with `run(inputs, output_shapes, output_dtypes)`
    (zeros by default) instead of building and running the kernel."""
    saved, _Stand.run = _Stand.run, run
    try:
        yield
    finally:
        _Stand.run = saved
