# The two commands of the README. Both install everything they need first.
.PHONY: serve test lint

serve:
	bash scripts/install.sh
	.venv/bin/lockserve serve

test:
	bash scripts/install.sh --test
	.venv/bin/python -m ruff check .
	TRITON_INTERPRET=1 .venv/bin/python -m pytest -q -m "not gpu" tests

lint:
	.venv/bin/python -m ruff check .
