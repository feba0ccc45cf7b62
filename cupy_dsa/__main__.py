"""``python -m cupy_dsa`` runs the ``cupy-dsa`` CLI."""
from cupy_dsa.bench.cli import main

if __name__ == "__main__":
    main()
