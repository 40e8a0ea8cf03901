"""Every rank draws random numbers as a process of its own would.

The ranks of a real job are processes. Each starts with torch's CPU generator at torch's fixed
start seed, so ranks that never seed still build identical ``nn.Linear`` weights, and
``torch.manual_seed(0)`` in a rank seeds that rank alone. Each has its own stdlib ``random``
and numpy global state, seeded from the OS. meshsim breaks that in three places, and this
module mends each:

* gloo and nccl workers are reused between jobs: a rank would start where the previous job
  left its generators. :func:`start_fresh` runs before each job.
* the fake tier runs every rank in turn in one thread: rank 1 would continue rank 0's torch
  stream. :func:`torch_fresh` runs before each rank (0.4 us, where reseeding numpy from the
  OS costs 150 us: a million-rank world would wait a minute; the ``random`` and numpy streams
  a rank continues are as different from its neighbours' as fresh OS seeds make them), and
  :func:`caller_state_kept` restores the caller's generators afterwards.
* the threaded tier runs the ranks as threads of one process, all on one generator: one
  rank's ``torch.manual_seed`` re-seeds every rank and their draws interleave (8 ranks that
  each seeded and built a ``Linear`` held 2 distinct models). :func:`threads_draw_apart`
  gives each rank thread a :class:`RankStreams` of its own.

On the threaded tier, each rank's torch generator state is swapped into torch's global
generator around every random torch call the rank makes (a torch function mode, which torch
keeps per thread), under one lock; the seeding functions (``torch.manual_seed``,
``torch.get_rng_state``, ...) and the module-level functions of ``random`` and
``numpy.random`` are replaced, while a threaded run lasts, by ones that act on the calling
rank's own state. Not covered: a reference taken before the run (``from random import
random``, ``g = torch.default_generator``) and explicit generators, which are private already.
"""

from __future__ import annotations

import functools
import random
import threading
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

#: torch calls that draw from the global generator, by ``__name__`` (functions, Tensor
#: methods, ``torch.nn.functional`` and ``torch.nn.init`` functions alike). A call with an
#: explicit ``generator=`` is swapped too, harmlessly.
RANDOM_CALLS = frozenset(
    {
        "rand", "rand_like", "randn", "randn_like", "randint", "randint_like", "randperm",
        "normal", "normal_", "uniform_", "bernoulli", "bernoulli_", "multinomial", "poisson",
        "binomial", "random_", "exponential_", "geometric_", "cauchy_", "log_normal_",
        "_standard_gamma", "_sample_dirichlet", "dropout", "dropout_", "dropout1d",
        "dropout2d", "dropout3d", "alpha_dropout", "alpha_dropout_", "feature_dropout",
        "feature_dropout_", "feature_alpha_dropout", "feature_alpha_dropout_",
        "native_dropout", "rrelu", "rrelu_", "gumbel_softmax", "fractional_max_pool2d",
        "fractional_max_pool3d", "trunc_normal_", "xavier_uniform_", "xavier_normal_",
        "kaiming_uniform_", "kaiming_normal_", "orthogonal_", "sparse_", "uniform",
    }
)  # fmt: skip
#: torch's seeding and state functions, replaced for rank threads while a threaded run lasts.
TORCH_STATE_FUNCTIONS = (
    "manual_seed", "seed", "initial_seed", "get_rng_state", "set_rng_state",
)  # fmt: skip
#: ``random`` module functions bound to its hidden global ``Random``.
RANDOM_FUNCTIONS = (
    "seed", "random", "uniform", "triangular", "randint", "choice", "randrange", "sample",
    "shuffle", "choices", "normalvariate", "lognormvariate", "expovariate", "vonmisesvariate",
    "gammavariate", "gauss", "betavariate", "paretovariate", "weibullvariate", "getstate",
    "setstate", "getrandbits", "randbytes", "binomialvariate",
)  # fmt: skip
#: ``numpy.random`` module functions bound to its legacy global ``RandomState`` (each a
#: ``RandomState`` method of the same name).
NUMPY_FUNCTIONS = (
    "seed", "get_state", "set_state", "rand", "randn", "randint", "random", "random_sample",
    "choice", "shuffle", "permutation", "normal", "uniform", "standard_normal", "binomial",
    "poisson", "exponential", "beta", "gamma", "bytes",
)  # fmt: skip

#: One rank's torch state is swapped into the global generator at a time.
_swap = threading.RLock()
_current = threading.local()


@functools.cache
def _fresh_torch_state() -> Any:
    """The CPU generator state of a process that never seeded: torch's fixed start seed."""
    import torch

    return torch.Generator().get_state()


def torch_fresh() -> None:
    """Torch's CPU generator as a new process has it."""
    import torch

    torch.default_generator.set_state(_fresh_torch_state())


def start_fresh() -> None:
    """Reset this process's generators to a new process's: torch at its start seed (CUDA too,
    where initialised), ``random`` and numpy's global state seeded from the OS."""
    import numpy
    import torch

    torch_fresh()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.manual_seed_all(torch.Generator().initial_seed())
    random.seed()
    numpy.random.seed()


@contextmanager
def caller_state_kept() -> Iterator[None]:
    """Restore the calling thread's generators after ranks ran in it (the fake tier)."""
    import numpy
    import torch

    saved = torch.get_rng_state(), random.getstate(), numpy.random.get_state()
    try:
        yield
    finally:
        torch.set_rng_state(saved[0])
        random.setstate(saved[1])
        numpy.random.set_state(saved[2])


class RankStreams:
    """One threaded rank's generators: torch's CPU state, a ``random.Random`` and a numpy
    ``RandomState``, each as a fresh process would have it."""

    def __init__(self) -> None:
        import numpy

        self.torch_state = _fresh_torch_state()
        self.random = random.Random()
        self.numpy = numpy.random.RandomState()
        #: The global generator's state this rank's swap put aside (None: not swapped in).
        self._put_aside: Any = None

    @contextmanager
    def swapped_in(self) -> Iterator[None]:
        """Torch's global generator holds this rank's state while inside (one rank at a time)."""
        import torch

        with _swap:
            outermost = self._put_aside is None
            if outermost:
                self._put_aside = torch.default_generator.get_state()
                torch.default_generator.set_state(self.torch_state)
            try:
                yield
            finally:
                if outermost:
                    self.torch_state = torch.default_generator.get_state()
                    torch.default_generator.set_state(self._put_aside)
                    self._put_aside = None

    @contextmanager
    def stepped_out(self) -> Iterator[None]:
        """Around a wait for other ranks inside a random call: this rank's state is put back
        and the lock released until the wait is over.

        A random op on a DTensor can run a collective (a redistribution, the RNG tracker's
        seed broadcast); a rank holding the lock there would wait for peers that wait for the
        lock to draw themselves: a hang no real job has.
        """
        import torch

        if self._put_aside is None:  # not inside a random call
            yield
            return
        self.torch_state = torch.default_generator.get_state()
        torch.default_generator.set_state(self._put_aside)
        self._put_aside = None
        held = 0
        while True:  # an RLock: every level this thread took
            try:
                _swap.release()
            except RuntimeError:
                break
            held += 1
        try:
            yield
        finally:
            for _ in range(held):
                _swap.acquire()
            self._put_aside = torch.default_generator.get_state()
            torch.default_generator.set_state(self.torch_state)


@contextmanager
def stepped_out() -> Iterator[None]:
    """:meth:`RankStreams.stepped_out` for the calling rank thread; nothing elsewhere."""
    streams = _rank_streams()
    if streams is None:
        yield
        return
    with streams.stepped_out():
        yield


def _rank_streams() -> RankStreams | None:
    return getattr(_current, "streams", None)


@functools.cache
def _rank_draws() -> type:
    """The torch function mode that runs a rank's random torch calls on its own state (a class
    made once: it needs torch, which this module does not import at import time)."""
    from torch.overrides import TorchFunctionMode

    class RankDraws(TorchFunctionMode):
        def __init__(self, streams: RankStreams) -> None:
            super().__init__()
            self.streams = streams

        def __torch_function__(
            self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
        ) -> Any:
            if getattr(func, "__name__", "") in RANDOM_CALLS:
                with self.streams.swapped_in():
                    return func(*args, **(kwargs or {}))
            return func(*args, **(kwargs or {}))

    return RankDraws


@contextmanager
def rank_streams(streams: RankStreams) -> Iterator[None]:
    """Inside a threaded rank's thread: its draws and seeds use ``streams``."""
    _current.streams = streams
    try:
        with _rank_draws()(streams):
            yield
    finally:
        _current.streams = None


def _per_rank(original: Callable, on_rank: Callable[..., Any]) -> Callable:
    """``original`` for any thread but a rank's; ``on_rank(streams, *args)`` for a rank's."""

    @functools.wraps(original)
    def call(*args: Any, **kwargs: Any) -> Any:
        streams = _rank_streams()
        if streams is None:  # not a rank thread: the process's own generator
            return original(*args, **kwargs)
        return on_rank(streams, *args, **kwargs)

    return call


def _swapped(original: Callable, streams: RankStreams, *args: Any, **kwargs: Any) -> Any:
    with streams.swapped_in():
        return original(*args, **kwargs)


def _own(generator: str, name: str, streams: RankStreams, *args: Any, **kwargs: Any) -> Any:
    return getattr(getattr(streams, generator), name)(*args, **kwargs)


@contextmanager
def threads_draw_apart() -> Iterator[None]:
    """While a threaded run lasts: seeding and module-level draws act on the calling rank."""
    import numpy
    import torch

    patches: list[tuple[Any, str, Callable]] = []
    for module in (torch, torch.random):
        for name in TORCH_STATE_FUNCTIONS:
            original = getattr(module, name)
            patches.append((module, name, functools.partial(_swapped, original)))
    patches += [(random, n, functools.partial(_own, "random", n)) for n in RANDOM_FUNCTIONS]
    patches += [(numpy.random, n, functools.partial(_own, "numpy", n)) for n in NUMPY_FUNCTIONS]
    with ExitStack() as undo:
        for module, name, on_rank in patches:
            if not hasattr(module, name):  # a function this Python or numpy lacks
                continue
            original = getattr(module, name)
            undo.callback(setattr, module, name, original)
            setattr(module, name, _per_rank(original, on_rank))
        yield
