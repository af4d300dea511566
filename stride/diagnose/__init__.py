"""``stride diagnose``: run one model two ways on the same token ids and name the first layer where they part.

:mod:`.spec` parses a run's configuration and the error band a pair should stay inside; :mod:`.runs` runs the
schedule (prefill, decode steps, a chunked prefill) through Stride's ranks or HuggingFace transformers and captures
every layer's hidden states; :mod:`.compare` measures the two captures layer by layer and reports; :mod:`.cli` is
the command. The JSON report is documented in ``docs/diagnose.md``.
"""
