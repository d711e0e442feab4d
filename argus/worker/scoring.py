"""Quality scores of a sample of the worker's images, for the router's drift monitor (§5.5).

A worker scores a random share (``argus worker --score-sample``, 0: off) of the images it
serves with PickScore (:class:`PickScorer`), off the request path:
:meth:`ScoreSampler.offer` is called after an image is made and only draws the sample and
queues the PNG; one background thread decodes and scores it. The queue is bounded: when it is
full the image is dropped and counted (``dropped``), so scoring never holds a request up or
grows memory under load.

**How the router learns the scores.** Scoring finishes after the reply that carried the image
has gone, so a score rides on a *later* reply of the same worker:
:meth:`ScoreSampler.take` drains the finished scores into the next ``GenerateResponse``
(``scores``, each with its prompt, level and request id). The router reads every reply, so
this needs no new RPC, no extra connection, and no state in the router per worker; scores
arrive one request late, which a monitor over windows of hundreds of scores does not notice.
The alternatives were worse: heartbeats go to the allocator, not the router; a Stats poll
would add a call per worker per period; scoring in the router would put CLIP on the router's
CPU beside the classifier (the request path) and leave the worker's accelerator idle for it.
At most ``max_done`` finished scores wait for a reply (older ones are dropped and counted),
so a worker that gets no more requests holds a bounded backlog.

Without ``--scorer`` a worker on the tiny models scores with a tiny random CLIP built from a
config with seeded weights (:func:`tiny_scorer`), as the tiny pipelines are built: the path
runs end to end on a CPU, but its scores measure nothing. A worker on real models scores only
with a PickScore directory (``--scorer``): a random CLIP's scores of real images would make the
router retrain its classifier on noise.
"""

from __future__ import annotations

import io
import logging
import os
import queue
import random
import tempfile
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from argus.contracts.generate import QualityScore

if TYPE_CHECKING:
    from PIL import Image

log = logging.getLogger(__name__)

DEFAULT_SAMPLE = 0.05  # share of images scored by default (argus worker --score-sample)


class PickScorer:
    """PickScore (or any CLIP) from a local directory: ``score(prompt, images) -> scores``.

    The worker's drift sample scores with it and so does ``argus profile``
    (:mod:`argus.tools.profiler`); torch and transformers load when one is made, so importing
    this module costs neither."""

    def __init__(self, model_dir: str | Path, device: str = "cpu") -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from transformers import AutoImageProcessor, AutoTokenizer, CLIPModel

        self.model_dir = Path(model_dir)
        if not (self.model_dir / "config.json").is_file():
            raise FileNotFoundError(f"scorer directory {self.model_dir} has no config.json")
        model: Any = CLIPModel.from_pretrained(
            self.model_dir, local_files_only=True, use_safetensors=True
        )
        self.model = model.to(device).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir, local_files_only=True)
        self.images = AutoImageProcessor.from_pretrained(self.model_dir, local_files_only=True)
        self.device = device
        self.max_tokens = int(self.model.config.text_config.max_position_embeddings)

    def score(self, prompt: str, images: Sequence[Image.Image]) -> list[float]:
        import torch

        text = self.tokenizer(
            [prompt], padding=True, truncation=True, max_length=self.max_tokens, return_tensors="pt"
        ).to(self.device)
        pixels = self.images(images=list(images), return_tensors="pt")["pixel_values"]
        with torch.inference_mode():
            out = self.model(
                input_ids=text["input_ids"],
                attention_mask=text["attention_mask"],
                pixel_values=pixels.to(self.device),
            )
        logits: torch.Tensor = out.logits_per_image[:, 0]
        return [float(v) for v in logits.cpu()]


class Scorer(Protocol):
    """What scores images (``PickScorer`` implements it)."""

    def score(self, prompt: str, images: Sequence[Any]) -> list[float]: ...


@dataclass(frozen=True)
class ScoringStats:
    """Counters of a :class:`ScoreSampler` since it started."""

    offered: int  # images offered (every served image)
    sampled: int  # images drawn into the sample
    scored: int  # images scored
    dropped: int  # sampled images dropped: the queue was full
    failed: int  # images whose scoring raised
    expired: int  # finished scores dropped before any reply carried them


class _Stop:
    pass


class ScoreSampler:
    """Scores ``rate`` of the offered images in a background thread; thread-safe.

    ``scorer`` is a :class:`Scorer`, or a function that loads one: it is then called on the
    scoring thread, so loading CLIP does not delay the worker's start (a load that fails is
    logged, and every sampled image counts as failed). ``rng`` draws the sample (seed it in
    tests). Call :meth:`close` to stop the thread.
    """

    def __init__(
        self,
        scorer: Scorer | Callable[[], Scorer],
        rate: float,
        *,
        rng: random.Random | None = None,
        max_queue: int = 16,
        max_done: int = 256,
    ) -> None:
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"rate: must be in [0, 1], got {rate}")
        if max_queue < 1 or max_done < 1:
            raise ValueError(f"max_queue, max_done: must be >= 1, got {max_queue}, {max_done}")
        self._scorer = scorer
        self.rate = rate
        self._rng = rng or random.Random()
        self._queue: queue.Queue[tuple[str, str, str, bytes] | _Stop] = queue.Queue(max_queue)
        self._done: deque[QualityScore] = deque()
        self.max_done = max_done
        self._lock = threading.Lock()
        self._offered = self._sampled = self._scored = 0
        self._dropped = self._failed = self._expired = 0
        self._thread = threading.Thread(target=self._loop, name="argus-scoring", daemon=True)
        self._thread.start()

    def offer(self, prompt: str, level: str, png: bytes, request_id: str = "") -> bool:
        """An image was served: queue it for scoring if the sample draws it and the queue has
        room. Returns True when queued. Never blocks."""
        with self._lock:
            self._offered += 1
            if self.rate <= 0.0 or self._rng.random() >= self.rate:
                return False
            self._sampled += 1
        try:
            self._queue.put_nowait((prompt, level, request_id, png))
        except queue.Full:
            with self._lock:
                self._dropped += 1
            return False
        return True

    def take(self) -> list[QualityScore]:
        """The finished scores not yet taken, oldest first (for the next reply)."""
        with self._lock:
            out = list(self._done)
            self._done.clear()
        return out

    def stats(self) -> ScoringStats:
        with self._lock:
            return ScoringStats(
                self._offered,
                self._sampled,
                self._scored,
                self._dropped,
                self._failed,
                self._expired,
            )

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until every queued image is scored; True when it is, False on timeout.

        Scoring runs on the scorer's own thread, so this is the synchronisation point that
        tests and callers use to read :meth:`stats` or the scores after the work queued so far
        is done (it waits for the queue, not for the thread to stop: :meth:`close` does that)."""
        done = threading.Event()

        def join() -> None:
            self._queue.join()
            done.set()

        threading.Thread(target=join, daemon=True).start()
        return done.wait(timeout)

    def close(self, timeout: float | None = 5.0) -> None:
        """Stop the thread after the images already queued."""
        self._queue.put(_Stop())
        self._thread.join(timeout)

    def _load(self) -> Scorer | None:
        if not callable(self._scorer):
            return self._scorer
        try:
            return self._scorer()
        except Exception:  # the worker serves on; its replies carry no scores
            log.exception("the quality scorer did not load; sampled images are not scored")
            return None

    def _loop(self) -> None:
        from PIL import Image

        scorer = self._load()
        while True:
            item = self._queue.get()
            try:
                if isinstance(item, _Stop):
                    return
                prompt, level, request_id, png = item
                try:
                    if scorer is None:
                        raise RuntimeError("no scorer")
                    image = Image.open(io.BytesIO(png)).convert("RGB")
                    value = float(scorer.score(prompt, [image])[0])
                except Exception as exc:  # a bad image or a scorer fault: count, keep serving
                    log.warning("scoring request %s failed: %s", request_id, exc)
                    with self._lock:
                        self._failed += 1
                    continue
                with self._lock:
                    self._scored += 1
                    self._done.append(QualityScore(prompt, level, value, request_id))
                    while len(self._done) > self.max_done:
                        self._done.popleft()
                        self._expired += 1
            finally:
                self._queue.task_done()


def write_tiny_clip(directory: str | Path, seed: int = 0) -> str | Path:
    """Write a tiny random CLIP scorer directory (32-wide, 2 layers, 32 px images; model, the
    repository's BERT tokenizer, image processor) with weights seeded by ``seed``.

    Its final norms are biased towards one shared direction so that every image-text cosine,
    and so every score, is positive, as PickScore's are (the drift rule compares a median with
    a fraction of an average, which assumes positive scores); the scores still depend on the
    image, and mean nothing."""
    import torch
    from transformers import AutoTokenizer, CLIPConfig, CLIPImageProcessor, CLIPModel

    from argus.embedding import default_encoder_dir

    tokenizer = AutoTokenizer.from_pretrained(default_encoder_dir(), model_max_length=77)
    common = {"hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4}
    config = CLIPConfig(
        text_config={
            **common,
            "vocab_size": tokenizer.vocab_size,
            "num_hidden_layers": 2,
            "max_position_embeddings": 77,
            "bos_token_id": tokenizer.cls_token_id,
            "eos_token_id": tokenizer.sep_token_id,
            "pad_token_id": tokenizer.pad_token_id,
        },
        vision_config={**common, "num_hidden_layers": 2, "image_size": 32, "patch_size": 8},
        projection_dim=16,
    )
    with torch.random.fork_rng():  # seed the weights without moving the caller's RNG
        torch.manual_seed(seed)
        model = CLIPModel(config).eval()
    with torch.no_grad():
        for norm in (model.text_model.final_layer_norm, model.vision_model.post_layernorm):
            norm.weight.mul_(0.1)
            norm.bias.fill_(1.0)
        model.visual_projection.weight.copy_(model.text_projection.weight)
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)
    CLIPImageProcessor(
        size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}
    ).save_pretrained(directory)
    return directory


def tiny_scorer(seed: int = 0) -> PickScorer:
    """A :class:`PickScorer` on :func:`write_tiny_clip`'s model: the default when no PickScore
    directory is given."""
    # PickScorer loads from a directory (as it loads real PickScore); write one and read it back
    with tempfile.TemporaryDirectory(prefix="argus-tiny-clip-") as directory:
        return PickScorer(write_tiny_clip(directory, seed))


def load_scorer(directory: str | None, device: str = "cpu") -> PickScorer:
    """The worker's scorer: PickScore (any CLIP) from ``directory`` on ``device``, else
    :func:`tiny_scorer` (on the CPU)."""
    if directory is None:
        return tiny_scorer()
    return PickScorer(directory, device)
