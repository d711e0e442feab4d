"""How long this worker takes to decode an image, so that a decode that cannot finish before
its request's deadline is never started.

The decode (the VAE and the PNG) is the last, and for a large image the longest, part of a
request. :class:`DecodeTimes` predicts it from this worker's own recent decodes, in seconds
per pixel; the worker checks the prediction against the time its request has left on
arrival, at each poll while it waits for the GPU slot (:mod:`argus.worker.gpu_queue`), and
before the decode itself. A request whose decode cannot fit is stopped with
:class:`DecodeSkipped` (reason "expired"), without decoding, or without running at all.
"""

from __future__ import annotations

import threading
from collections import deque

from argus.worker.models.pipelines import Cancelled

# the decode time (VAE and PNG) assumed before a worker has decoded an image of about a size:
# 2 µs a pixel, 8.4 s at 2048×2048. Slow on purpose, so that a worker does not start decodes it
# has no measure of and cannot finish: about three times the tiny models' tiled decode and PNG
# on two idle CPU cores (0.7 µs a pixel at 2048×2048; measured). Its own decodes replace it
DECODE_SEED_S_PER_PIXEL = 2e-6


class DecodeSkipped(Cancelled):
    """A request was stopped because its decode (predicted ``predicted_s``) cannot finish in
    the ``left_s`` seconds before its deadline; reason "expired"."""

    def __init__(self, steps_done: int, predicted_s: float, left_s: float) -> None:
        super().__init__("expired", steps_done)
        self.predicted_s = predicted_s
        self.left_s = left_s

    def __str__(self) -> str:
        return (
            f"deadline too close: decoding takes about {self.predicted_s:.2f} s, "
            f"{max(self.left_s, 0.0):.2f} s left ({self.steps_done} steps run)"
        )


class DecodeTimes:
    """How long this worker takes to decode an image (VAE and PNG), learned from its own
    decodes, to skip a decode that cannot finish before the deadline.

    Each decode gives a rate, seconds per pixel. A prediction for ``pixels`` is ``pixels ×``
    the ``quantile`` (a high one: a slow decode is likely to recur under the same load) of the
    rates of the last ``window`` decodes of images at least a quarter that size, each weighted
    by ``decay`` to the power of its age in decodes, so that a worker whose load changed is
    learned again within a few decodes. Smaller images are left out because a fixed cost per
    image dominates theirs (the tiny models decode 64×64 at 7 µs a pixel, 2048×2048 at 0.7 µs;
    measured); tiles keep the rate of large images flat (:meth:`DiffusionModel.decode`). With
    no decode that large yet, the rate is ``seed_s_per_pixel``, or the smaller images' rate
    when that is lower. Thread-safe.
    """

    def __init__(
        self,
        seed_s_per_pixel: float = DECODE_SEED_S_PER_PIXEL,
        *,
        window: int = 32,
        decay: float = 0.8,
        quantile: float = 0.9,
    ) -> None:
        if seed_s_per_pixel < 0.0:
            raise ValueError(f"seed_s_per_pixel: must be >= 0, got {seed_s_per_pixel}")
        if not 0.0 < decay <= 1.0 or not 0.0 < quantile <= 1.0:
            raise ValueError(f"decay and quantile: must be in (0, 1], got {decay}, {quantile}")
        self.seed_s_per_pixel = seed_s_per_pixel
        self.decay = decay
        self.quantile = quantile
        self._samples: deque[tuple[int, float]] = deque(maxlen=window)  # (pixels, s/px)
        self._lock = threading.Lock()

    def observe(self, pixels: int, seconds: float) -> None:
        """A decode of ``pixels`` took ``seconds``."""
        if pixels > 0:
            with self._lock:
                self._samples.append((pixels, seconds / pixels))

    def predict_s(self, pixels: int) -> float:
        """Seconds a decode of ``pixels`` is expected to take (see the class's docstring)."""
        with self._lock:
            samples = list(self._samples)
        alike = [(i, r) for i, (p, r) in enumerate(samples) if 4 * p >= pixels]
        if alike:
            return pixels * self._quantile(alike, len(samples))
        rate = self.seed_s_per_pixel
        if samples:
            rate = min(rate, self._quantile(list(enumerate(r for _, r in samples)), len(samples)))
        return pixels * rate

    def _quantile(self, indexed: list[tuple[int, float]], count: int) -> float:
        """The weighted ``quantile`` of the rates; ``indexed`` pairs (position, rate), the
        newest of ``count`` samples at position ``count - 1``, weighted ``decay ** age``."""
        weighted = sorted((rate, self.decay ** (count - 1 - i)) for i, rate in indexed)
        goal = self.quantile * sum(w for _, w in weighted)
        total = 0.0
        for rate, weight in weighted:
            total += weight
            if total >= goal - 1e-12:
                return rate
        return weighted[-1][0]
