module toffload.dev/accelhttp

go 1.19
