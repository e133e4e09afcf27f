"""ddpjob's version, in a module of its own: the script header (launch/render.py), the frozen
code record (freeze.py), each checkpoint's manifest (store/commit.py), `ddpjob --version` and
setup.cfg read it here, so none of them imports the package's face (`ddpjob/__init__.py`, which
re-exports it as `ddpjob.__version__`) from below it."""

__version__ = "0.2.0"
