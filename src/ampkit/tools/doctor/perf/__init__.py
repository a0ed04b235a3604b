"""The performance doctor: where a training step's time goes (session, ops, syncs), the findings and the
device advisor."""
