"""The router's classifier: a prompt's optimal approximation level, one model per strategy.

Argus §4.1: a BERT-family encoder reads the prompt and predicts the fastest level whose image
quality stays within δ of the prompt's best (:mod:`argus.classifier.labels`). Two backbones
share one inference path, *encoder → mean-pooled unit vector → linear head → softmax*:

* ``logistic``: the encoder is frozen (all-MiniLM-L6-v2 by default) and the head is a
  multinomial logistic regression (scikit-learn at training time, numpy at inference). Small
  enough to commit. The default everywhere, ``classifiers/minilm-l2-logistic-int8``, reads
  the encoder's first 2 layers only (a *student*, :mod:`~argus.classifier.distill`), in int8;
  ``classifiers/minilm-logistic`` reads all 6, in float32.
* ``finetune``: the encoder is fine-tuned with the head (LP-FT: the logistic head first, then
  everything), as in the paper. Its encoder weights (~90 MB for MiniLM) are written beside the
  head and kept out of git.

Modules, in the order data flows:

* :mod:`~argus.classifier.prompts`: what counts as a prompt; empty, huge and non-UTF-8 input;
* :mod:`~argus.classifier.labels`: labels from a quality table (the δ rule);
* :mod:`~argus.classifier.model`: the classifier, its artifact format, loading;
* :mod:`~argus.classifier.train`: training either backbone on the fixed prompt split
  (:mod:`argus.prompt_split`: weights from TRAIN, calibration from CALIBRATION, metrics on EVAL);
* :mod:`~argus.classifier.calibration`: temperature scaling, tolerance classes and the
  per-class quality table Q(v | c) the joint planner uses (``calibration.json``);
* :mod:`~argus.classifier.evaluate`: accuracy, macro-F1, confusion matrix, downstream quality;
* :mod:`~argus.classifier.serving`: prompt checks, hot-swappable models, the micro-batcher,
  classes for the router and Q(v | c) for the allocator;
* :mod:`~argus.classifier.embedding_cache`: encoder vectors kept on disk by content (replays);
* :mod:`~argus.classifier.drift`: drift detection and background retraining;
* :mod:`~argus.classifier.distill`: student encoders (MiniLM's first layers, optionally
  distilled to the whole) and their heads.

Nothing here imports torch, transformers or scikit-learn at import time; they load when a
model is loaded or trained.
"""
