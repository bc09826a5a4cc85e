"""The admin API's handlers for a model's count (docs/autoscaling.md): scaling it (on an autoscaled
model, pinning the count, or releasing the pin) and the autoscalers' explanations. Each is
``async (app, call) -> answer``; admin/server.py registers them by route name.

The plane's autoscaling shell (``control.autoscaling``) answers ``view(model)`` (an AutoscaleView;
None for a model without [models.autoscale]; KeyError for no such model) and ``views()``; a
daemon without the shell has no autoscaled model."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from llmgw.admin.schema import Problem
from llmgw.config import ConfigError, model_to_dict
from llmgw.daemon.control.admin.errors import AdminFail, invalid
from llmgw.daemon.control.plane.plane import ModelError
from llmgw.inputs.echo import echo

__all__ = ["AUTOSCALE_HANDLERS"]

Handler = Callable[[Any, Any], Awaitable[Any]]


def _no_autoscale(name: str) -> AdminFail:
    return AdminFail(409, f"Model {echo(name)} has no [models.autoscale]: its count is its deploy profile's "
                          "(`llmgw ctl scale MODEL N` sets it).")


async def scale_model(app: Any, call: Any) -> Any:
    """`{"replicas": N}` sets the count (pins it on an autoscaled model); `{"release": true}` unpins."""
    name, body = call.params["name"], call.body
    actions = app.control.actions
    try:
        if body.release:
            release = getattr(actions, "release_scale", None)
            if release is None:  # a plane without autoscaling: no model has a pin to release
                if name not in app.control.models:
                    raise KeyError(name)
                raise _no_autoscale(name)
            release(name)
            m = app.control.models[name]
        else:
            m = actions.scale(name, body.replicas)
    except KeyError:
        raise AdminFail(404, f"No model {echo(name)}.") from None
    except ModelError as e:
        raise AdminFail(409, str(e)) from None
    except ConfigError as e:
        raise invalid([Problem(p.key, p.message) for p in e.problems], "invalid_body") from None
    return model_to_dict(m)


async def list_autoscale(app: Any, call: Any) -> Any:
    shell = getattr(app.control, "autoscaling", None)
    return [] if shell is None else list(shell.views())


async def get_model_autoscale(app: Any, call: Any) -> Any:
    name = call.params["name"]
    shell = getattr(app.control, "autoscaling", None)
    try:
        view = shell.view(name) if shell is not None else None
    except KeyError:
        raise AdminFail(404, f"No model {echo(name)}.") from None
    if view is None:
        if name not in app.control.models:
            raise AdminFail(404, f"No model {echo(name)}.")
        raise _no_autoscale(name)
    return view


AUTOSCALE_HANDLERS: dict[str, Handler] = {
    f.__name__: f for f in (scale_model, list_autoscale, get_model_autoscale)
}
