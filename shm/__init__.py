"""ggmux.shm"""
