"""nanwatch's benchmark suite (issue 8): ``python benchmarks/run.py --help``.

Not part of the installed package; nothing here is imported by ``nanwatch``.
"""
