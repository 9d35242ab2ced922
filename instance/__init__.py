"""ggmux.instance"""
