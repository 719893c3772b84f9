# The two commands of the README. Both install everything they need first.
.PHONY: serve test lint

serve:
	bash scripts/install.sh
	.venv/bin/lockserve serve

# `lockserve report --check`: the generated blocks of README.md, docs/results/README.md and
# docs/results/AUDIT.md are current, and README.md cites no measured figure that no result file holds.
# The CPU suite on two workers (-n 2, CI's two cores), a test file at a time on each: a file's
# module fixtures (a Ray cluster, a served model) are set up once, on one worker.
test:
	bash scripts/install.sh --test
	.venv/bin/python -m ruff check .
	.venv/bin/lockserve report --check
	TRITON_INTERPRET=1 .venv/bin/python -m pytest -q -m "not gpu" -n 2 --dist loadfile --durations=15 tests

lint:
	.venv/bin/python -m ruff check .
