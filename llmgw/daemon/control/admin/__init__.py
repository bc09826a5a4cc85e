"""The admin API's HTTP shell (server.py) and its handlers, errors and event stream."""
