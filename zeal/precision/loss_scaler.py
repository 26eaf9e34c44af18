"""Loss scaling for fp16 (never used with bf16 or fp32)."""

from __future__ import annotations

from zeal.config.schema import FP16Config


class LossScaler:
    """Static when ``loss_scale > 0``, else dynamic:

    * an overflow (any rank) skips the step; once ``hysteresis`` overflows have been
      seen the scale halves (never below ``min_loss_scale``);
    * after ``loss_scale_window`` consecutive good steps the scale doubles.
    """

    def __init__(self, cfg: FP16Config) -> None:
        self.dynamic = cfg.loss_scale == 0
        self.scale = float(2 ** cfg.initial_scale_power) if self.dynamic else float(cfg.loss_scale)
        self.window = cfg.loss_scale_window
        self.hysteresis = cfg.hysteresis
        self.consecutive_hysteresis = cfg.consecutive_hysteresis
        self.min_scale = cfg.min_loss_scale
        self.cur_hysteresis = cfg.hysteresis
        self.good_steps = 0

    def update(self, overflow: bool) -> None:
        if not self.dynamic:
            return
        if overflow:
            if self.cur_hysteresis <= 1:
                self.scale = max(self.scale / 2, self.min_scale)
            else:
                self.cur_hysteresis -= 1
            self.good_steps = 0
            return
        if self.consecutive_hysteresis:
            self.cur_hysteresis = self.hysteresis
        self.good_steps += 1
        if self.good_steps % self.window == 0:
            self.scale *= 2
            self.cur_hysteresis = self.hysteresis

    def state_dict(self) -> dict:
        return {"scale": self.scale, "cur_hysteresis": self.cur_hysteresis, "good_steps": self.good_steps}

    def load_state_dict(self, sd: dict) -> None:
        self.scale = float(sd["scale"])
        self.cur_hysteresis = int(sd["cur_hysteresis"])
        self.good_steps = int(sd["good_steps"])
