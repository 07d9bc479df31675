//! libtoffload.so: the LD_PRELOAD fiber runtime. Placeholder while the scheduler lands.
