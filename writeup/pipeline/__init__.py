"""The writeup's build pipeline: results files in, Typst data and figures out (``writeup/build.py`` drives it).

* :mod:`.results`: reading ``writeup/results/*.jsonl`` (latest row per configuration, one device), the
  environment line every measured section prints, and :class:`~.results.Missing`;
* :mod:`.markup`: number formatting and tables as data that ``typ/lib.typ`` typesets;
* :mod:`.figures`: matplotlib helpers (Agg backend, one style);
* :mod:`.accounting`: the derivations (memory, communication, overhead models) as plain functions;
* :mod:`.snapshot_reports`: what ``scripts/memory_snapshot_report.py`` printed about allocator snapshots, read back
  from a run's log;
* :mod:`.sections`: one function per problem, each returning what its Typst section reads.
"""
