"""The single-controller training loops (policy gradient today) and the `diffrl train` driver."""
