"""The model layer: ``make_invariant`` patches a Hugging Face causal LM onto the kernels.

Files: ``patch`` (``make_invariant``, ``restore``), ``attention`` and ``experts`` (the entries
registered in transformers' ``AttentionInterface`` and ``ExpertsInterface``), ``padding`` and
``packing`` (positions and sequence bounds from masks and packed batches), ``tensor_parallel``
(the TP-size-independent arithmetic), ``vision`` and ``multimodal`` (a vision-language model's
tower and the positions around its language model), ``encoder`` (the BERT and XLM-RoBERTa encoders),
``families/`` (one adapter per model family)."""
