"""The stand-in's device memory: per-rank KV state tensors with Neuron's copy rules.

neuronx-distributed's only write API for a model's state, write_to_neuron_buffer
(neuronx_distributed/trace/trace.py), takes a whole buffer. A public report
(LMCache's Neuron backend) found that copy_ into a slice of a state tensor works
host-to-device one contiguous run at a time (narrow + copy_), while the runtime
refuses a device-to-device copy between tensors of different parents
(nrt_tensor_copy status=2). DeviceTensor refuses both failing forms, and counts
the bytes moved to the host so a test can see what a read moved.
"""

from __future__ import annotations

import torch


class DeviceTensor(torch.Tensor):
    bytes_to_host = 0  # class-wide counter; tests reset it

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.Tensor.copy_, torch.Tensor.__setitem__):
            target, source = args[0], args[-1] if func is torch.Tensor.copy_ else args[2]
            _check_device_write(target, source)
        if func is torch.Tensor.cpu or (func is torch.Tensor.to and _names_cpu(args[1:], kwargs)):
            with torch._C.DisableTorchFunctionSubclass():
                host = args[0].clone()
                out = host.to(*args[1:], **kwargs) if func is torch.Tensor.to else host
            DeviceTensor.bytes_to_host += out.numel() * out.element_size()
            return out
        return super().__torch_function__(func, types, args, kwargs)


def _names_cpu(args, kwargs) -> bool:
    where = [a for a in args if isinstance(a, (str, torch.device))] + [kwargs.get("device")]
    return any(w is not None and torch.device(w).type == "cpu" for w in where)


def _check_device_write(target, source) -> None:
    with torch._C.DisableTorchFunctionSubclass():
        if isinstance(source, DeviceTensor):
            raise RuntimeError("nrt_tensor_copy status=2: device-to-device copy into a slice of another state tensor (write from host memory)")
        if not target.is_contiguous():
            raise RuntimeError(f"write into a non-contiguous slice {tuple(target.shape)} strides {target.stride()} of a device state tensor: "
                               "copy one contiguous run at a time (narrow + copy_ from host memory)")


def device_view(plain: torch.Tensor) -> DeviceTensor:
    """The adapter's handle on a state tensor; shares the stand-in's storage."""
    return plain.as_subclass(DeviceTensor)
