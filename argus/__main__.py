from argus.cli.main import main
from argus.plumbing.heap import limit_malloc_arenas

limit_malloc_arenas()  # before any thread starts (argus/plumbing/heap.py)
raise SystemExit(main())
