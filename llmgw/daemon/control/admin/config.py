"""The admin API's handlers for the config file while the daemon runs (routes tagged `config` in
llmgw.admin.routes): check and reload (plane/config_reload.py). admin/server.py registers them by
route name. A file that does not parse is a 400 naming each problem with its file:line."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from llmgw.admin.schema import Problem
from llmgw.config import ConfigError
from llmgw.daemon.control.admin.errors import AdminFail
from llmgw.daemon.control.plane.config_reload import NoConfigFile

__all__ = ["CONFIG_HANDLERS"]

Handler = Callable[[Any, Any], Awaitable[Any]]


def _reloader(app: Any) -> Any:
    r = getattr(app.control, "reloader", None)
    if r is None:
        raise AdminFail(409, "this router has no config reloader (it is still starting)")
    return r


def _refused(e: ConfigError) -> AdminFail:
    problems = [Problem(f"{p.file}:{p.line}" if p.line is not None else p.file, f"{p.key}: {p.message}"
                        if p.key else p.message) for p in e.problems]
    return AdminFail(400, "the config file was not reloaded, nothing changed:\n" + "\n".join(map(str, e.problems)),
                     code="invalid_config", problems=problems)


def _run(app: Any, reload: bool) -> Any:
    """Check or reload, with the reloader's two refusals as the admin API answers them."""
    r = _reloader(app)
    try:
        return r.reload() if reload else r.check()
    except ConfigError as e:
        raise _refused(e) from None
    except NoConfigFile as e:
        raise AdminFail(409, str(e)) from None


async def check_config(app: Any, call: Any) -> Any:
    return _run(app, reload=False)


async def reload_config(app: Any, call: Any) -> Any:
    return _run(app, reload=True)


CONFIG_HANDLERS: dict[str, Handler] = {f.__name__: f for f in (check_config, reload_config)}
