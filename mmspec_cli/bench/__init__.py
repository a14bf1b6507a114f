"""``mmspec bench``: run drafters over a set of samples, record every turn, summarise.

One module per job:

- :mod:`.samples`: the :class:`Sample` type, JSONL manifests, ``--limit``/``--shard`` selection;
- :mod:`.sources`: SOURCE -> samples (manifest path, built-in suite, Hugging Face dataset id);
- :mod:`.hub`: field adapters for the Hugging Face datasets of TABED App. J;
- :mod:`.prompts`: TABED App. I.1 dataset prompts (``--prompt-style paper``);
- :mod:`.records`: the JSONL results file (append + fsync per record, resume);
- :mod:`.runner`: samples x drafters over one loaded :class:`~mmspec_cli.api.ModelSet`;
- :mod:`.progress`: the progress bar on stderr;
- :mod:`.summary`: pure functions from records to the summary numbers;
- :mod:`.report`: the summary as a rich table, JSON or CSV;
- :mod:`.peers`: decoders other than the engine as bench rows (``hf-assisted``);
- :mod:`.latency`: T_p, T_q and c for ``profile-latency`` and Eq. (1).
"""
