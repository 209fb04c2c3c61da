"""Harmony for gpt-oss: requests -> prompt token ids, generated ids -> items and events.

Built on openai-harmony only; nothing here imports MAX or the web stack.
"""
