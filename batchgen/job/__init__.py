"""Dataset-in, dataset-out jobs: ``python -m batchgen job CONFIG``.

config (validated whole before the model loads) -> source (streamed record batches) -> request
builder (tokenize, chat template, per-row parameters, row id) -> engine -> output assembler ->
sink (atomic Parquet / JSONL shards; the shards themselves record what is done, so a restarted
job skips finished rows) -> report.
"""
