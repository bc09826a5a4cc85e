"""The control plane's store: the SQLite store (sqlite.py) and its rows, the guard every access goes through,
loading and writing back the state."""
