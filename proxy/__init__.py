"""ggmux.proxy"""
