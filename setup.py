"""Packaging beyond pyproject.toml: the top-level conf/ ships inside the wheel as the package pcdist/conf.

conf/ stays where a checkout's train.py and Hydra users expect it; package-dir maps it into
the package, so an installed wheel carries the configs (pcdist.config.CONF_DIR finds either).
"""

from pathlib import Path

from setuptools import find_packages, setup

CONF = ["pcdist.conf"] + [f"pcdist.conf.{d.name}" for d in sorted(Path("conf").iterdir()) if d.is_dir()]

setup(
    packages=find_packages(include=["pcdist", "pcdist.*"]) + CONF,
    package_dir={"pcdist.conf": "conf"},
    package_data={"pcdist.engine": ["_native.c"], **{p: ["*.yaml"] for p in CONF}},  # _native.c: the fused CPU kernel
)
