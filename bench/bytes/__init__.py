"""Bytes on the wire: what a learner sends and receives per token against data-parallel
(communication), and how few bytes the product can send at a given loss (bytes_loss,
bytes_loss_narrow)."""
