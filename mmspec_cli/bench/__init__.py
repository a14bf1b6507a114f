"""``mmspec bench``: run drafters over a set of samples, record every turn, summarise.

Its samples come from :mod:`mmspec_cli.inputs` (SOURCE, manifests, datasets, the paper's prompts), which
training and select-layer read too. One module per job:

- :mod:`.records`: the JSONL results file (append + fsync per record, resume);
- :mod:`.runner`: samples x drafters over one loaded :class:`~mmspec_cli.api.ModelSet`;
- :mod:`.progress`: the progress bar on stderr;
- :mod:`.summary`: pure functions from records to the summary numbers;
- :mod:`.report`: the summary as a rich table, JSON or CSV;
- :mod:`.peers`: decoders other than the engine as bench rows (``hf-assisted``);
- :mod:`.latency`: T_p, T_q and c for ``profile-latency`` and Eq. (1).
"""
