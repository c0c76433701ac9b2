"""Flowcast's library: workflow execution and the durable event stream.

``lib`` never imports ``app`` or FastAPI; everything here takes its clients and options
as keyword arguments.
"""
