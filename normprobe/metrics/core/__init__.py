"""What the metric families share, kept apart from them so that `normprobe.metrics` lists the
families alone: the interfaces a family works through (`base`), what an attention reader is
handed (`attention`), the parameter, stream and gradient reads several families share
(`params`, `streams`, `grads`), and a finished run as the families read it back (`run`).
"""
