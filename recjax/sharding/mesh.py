"""The device mesh from `config.mesh.shape`: axes ("data", "model").

    --config.mesh.shape=data=4,model=2     4 x 2 devices
    --config.mesh.shape=""                 (default) every device on the `data` axis

Batches are split over every device (both axes, `data` major); the `model` axis is what row-wise tables may be
split over (`sharding.row_axes=model`, replicated along `data`). A mesh of one device means the single-device
engine runs, untouched (`make_mesh` returns None).
"""

import math
import re

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from recjax.errors import ConfigError

AXES = ("data", "model")
_PART = re.compile(r"^\s*(\w+)\s*=\s*(\d+)\s*$")


def parse_mesh_shape(text: str) -> dict[str, int]:
    """"data=4,model=2" -> {"data": 4, "model": 2}; "" -> {} (the default: every device on `data`)."""
    if not isinstance(text, str):
        raise ConfigError("mesh.shape", f"must be a string such as 'data=4,model=2', got {text!r}")
    shape: dict[str, int] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        match = _PART.match(part)
        if not match:
            raise ConfigError("mesh.shape", f"cannot read {part!r} in {text!r}; write axis=size pairs, e.g. "
                                            "'data=4,model=2'")
        axis, size = match.group(1), int(match.group(2))
        if axis not in AXES:
            raise ConfigError("mesh.shape", f"unknown axis {axis!r} in {text!r}; the axes are {list(AXES)}")
        if axis in shape:
            raise ConfigError("mesh.shape", f"axis {axis!r} appears twice in {text!r}")
        if size < 1:
            raise ConfigError("mesh.shape", f"axis {axis!r} must have >= 1 devices, got {size}")
        shape[axis] = size
    return shape


def mesh_shape(text: str, device_count: int) -> dict[str, int]:
    """The full {"data": n_data, "model": n_model} for `device_count` devices, or a ConfigError with the numbers."""
    shape = parse_mesh_shape(text)
    if "data" not in shape:
        model = shape.get("model", 1)
        if device_count % model:
            raise ConfigError("mesh.shape", f"model={model} does not divide the {device_count} devices")
        shape["data"] = device_count // model
    shape.setdefault("model", 1)
    total = math.prod(shape.values())
    if total != device_count:
        raise ConfigError("mesh.shape", f"{text!r} is {shape['data']} x {shape['model']} = {total} devices, but "
                                        f"{device_count} are available (jax.device_count()); make the product "
                                        f"{device_count}, or set JAX_NUM_CPU_DEVICES / the number of processes")
    return {axis: shape[axis] for axis in AXES}


def make_mesh(text: str, devices=None) -> Mesh | None:
    """The mesh for `config.mesh.shape` over `devices` (default: every device of every process); None for 1 device,
    which selects the single-device engine."""
    devices = jax.devices() if devices is None else list(devices)
    shape = mesh_shape(text, len(devices))
    if len(devices) == 1:
        return None
    if devices == jax.devices():
        return jax.make_mesh(tuple(shape.values()), AXES, axis_types=(AxisType.Auto,) * len(AXES))
    return Mesh(np.array(devices).reshape(tuple(shape.values())), AXES, axis_types=(AxisType.Auto,) * len(AXES))
