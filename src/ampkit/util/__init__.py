"""Leaves every layer may use: atomic files, argument checks, versions.

They import nothing of ampkit's but `ampkit.errors`.
"""
