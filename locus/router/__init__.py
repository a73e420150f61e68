"""`locus route`: the plan's grouper in front of the engines people already run.

An OpenAI-compatible router for data-parallel ranks (one endpoint per rank, or per group of ranks with a
rank pin): each request goes to the rank the placement plan's grouper chooses, as a Locus
expert-parallel server's rank 0 admits it (locus/routing/grouping/), and its answer comes back chunk
for chunk. It sits beside locus/server above the routing layer and talks to the engines over HTTP
only: it never imports locus.engine.

    backends.py   the engines, their ranks, health and rank pins
    prompts.py    a request's prompt token ids, as the engine will tokenize them
    admission.py  the grouper's choice and the assignment log
    intake.py     a client request read into what the grouper and the backend need
    relay.py      one request's trip: attempts, retry, the stream passed back, disconnects
    upstream.py   the HTTP/1.1 client to the backends: pooled keep-alive connections, httptools' parser
    metrics.py    /metrics
    app.py        the HTTP app; setup.py assembling it from flags, every check first; cli.py `locus route`
"""
