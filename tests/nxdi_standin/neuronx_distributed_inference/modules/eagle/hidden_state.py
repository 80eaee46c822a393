"""Stand-in for NxDI 0.9.0's modules/eagle/hidden_state.py: HiddenStateRollingBuffer, written from reading it.

A buffer of [max_batch_size + 1, buffer_length, hidden] (the last row the padded rows' garbage), a hidden
state stored at (seq_id, position % buffer_length). set_state is called with the NEXT position ids and
get_state with the current ones, so what a step reads is the hidden state of the position before its input."""

from __future__ import annotations

import torch


class HiddenStateRollingBuffer:
    def __init__(self, max_batch_size: int, buffer_length: int, hidden_size: int, dtype: torch.dtype = torch.float32,
                 apply_seq_ids_mask: bool = False):
        self.max_batch_size = max_batch_size
        self.buffer_length = buffer_length
        self.apply_seq_ids_mask = apply_seq_ids_mask
        self.hidden_states = torch.zeros((max_batch_size + 1, buffer_length, hidden_size), dtype=dtype)

    def _rows(self, seq_ids: torch.Tensor) -> torch.Tensor:
        seq_ids = seq_ids.reshape(seq_ids.shape[0])
        if self.apply_seq_ids_mask and seq_ids.shape[0] > 1:  # a padded row (seq_id -1) goes to the garbage row
            seq_ids = torch.where(seq_ids >= 0, seq_ids, torch.full_like(seq_ids, self.max_batch_size))
        return seq_ids

    def set_state(self, seq_ids: torch.Tensor, position_ids: torch.Tensor, hidden_state: torch.Tensor) -> torch.Tensor:
        """hidden_state [batch, 1, hidden] at each row's position_ids [batch, 1]; the buffer as the traced model's
        new state (index_put, the buffer kept here as the device would keep its aliased output)."""
        index = (self._rows(seq_ids), position_ids.reshape(position_ids.shape[0]) % self.buffer_length)
        self.hidden_states = torch.index_put(self.hidden_states, index, hidden_state.squeeze(1).to(self.hidden_states.dtype))
        return self.hidden_states

    def get_state(self, seq_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """[batch, 1, hidden]: what set_state stored at each row's position_ids."""
        index = position_ids.reshape(position_ids.shape[0]) % self.buffer_length
        return self.hidden_states[self._rows(seq_ids), index].unsqueeze(1)
