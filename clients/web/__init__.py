"""The browser voice/video demo's static files (index.html, ES modules, AudioWorklets, CSS), installed as the
package `streamserve.web` so that the server finds them with importlib (streamserve/server/transports/static.py)."""
