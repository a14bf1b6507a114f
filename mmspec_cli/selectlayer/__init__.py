"""``mmspec select-layer``: FastVLM App. A.4's reward (pure) and the calibration runs over the target."""
