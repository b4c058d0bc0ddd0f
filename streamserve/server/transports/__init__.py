"""The transports: what moves frames and HTTP between a client and the server, knowing no wire protocol. The
connection transport (transport.py: a bounded writer over a WebSocket or another Channel, rate limits, abort), who
the client is and what it may ask of HTTP itself (clients.py), the HTTP errors every route shares (http_replies.py)
and the browser demo's static files (static.py). They import nothing of the session service, the media runtime, the
protocol adapters (server/adapters/) or the composition root (app.py, drain.py): only each other."""
