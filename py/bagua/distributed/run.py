"""``python -m bagua.distributed.run [options] script.py [args]``: Bagua's
elastic launcher by name. It is ``bagua.distributed.launch`` (torchrun with
its elastic options, ``--max_restarts``, ``--rdzv_backend``..., plus Bagua's
launcher options): see that module."""

from bagua.distributed.launch import main

__all__ = ["main"]

if __name__ == "__main__":
    main()
