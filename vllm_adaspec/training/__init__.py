"""Trainers for what the drafters need: self-distillation data (`distill`), the EESD exit layer (`exit_layer`)."""
