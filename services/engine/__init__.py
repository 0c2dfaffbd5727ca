"""Embedded CPU model server: a tiny real causal LM behind SGLang's HTTP surface.

Modules: ``modelinit`` (write a model dir), ``model``/``weights`` (plain-torch forward),
``sampling``/``sequence``/``engine`` (continuous batching), ``policy`` (scripted replies),
``protocol`` (SGLang shapes), ``app``/``server`` (litestar), ``cli`` (typer).
"""
