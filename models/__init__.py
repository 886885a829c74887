"""Flax model graphs per architecture (installed as ``exl3_jax.models``)."""
