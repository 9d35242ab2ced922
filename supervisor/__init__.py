"""ggmux.supervisor"""
