from argus.cli.main import main
from argus.heap import limit_malloc_arenas

limit_malloc_arenas()  # before any thread starts (argus/heap.py)
raise SystemExit(main())
