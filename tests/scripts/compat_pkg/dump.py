"""`python -m compat_pkg.dump`: the dump worker (../dump_worker.py) started as a module."""

from dump_worker import dump

if __name__ == "__main__":
    dump("module " + __spec__.name)
