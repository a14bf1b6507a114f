"""What the commands that run over many samples read: a SOURCE turned into samples (bench, train-head, select-layer).

- :mod:`.samples`: the :class:`~.samples.Sample` type, JSONL manifests, MMSpec's folders, ``--limit``/``--shard``
  selection, image files checked before loading;
- :mod:`.sources`: SOURCE -> samples (a manifest path, a built-in suite, a Hugging Face dataset id);
- :mod:`.hub`: field adapters for the Hugging Face datasets of TABED App. J;
- :mod:`.prompts`: TABED App. I.1 dataset prompts (``--prompt-style paper``).
"""
