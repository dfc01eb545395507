"""peft adapters: what an adapter is (``config.py``: adapter_config.json; ``lora.py``: its LoRA weights and targets),
which are refused (``checks.py``), what a merge changes of a tied or resized base (``tied.py``) or of a parameter
(``params.py``), the merge's arithmetic, bit for bit with peft (``merge.py``), and the NaN and ±inf it makes
(``finite.py``)."""
