"""Pipeline stages: which contiguous range of layers a stage owns."""

from dataclasses import dataclass


@dataclass(frozen=True)
class PPStage:
    """This rank's pipeline stage; layers keep their global numbers."""

    rank: int = 0
    size: int = 1
    start_layer: int = 0  # first layer owned
    end_layer: int | None = None  # one past the last layer owned; None: all

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.size - 1

    def owns(self, layer: int) -> bool:
        return self.start_layer <= layer and (self.end_layer is None or layer < self.end_layer)


def split_layers(num_layers: int, num_stages: int) -> list[tuple[int, int]]:
    """Even split; earlier stages take the remainder: 10 layers / 3 -> (0,4), (4,7), (7,10)."""
    if not 1 <= num_stages <= num_layers:
        raise ValueError(
            f"pipeline size {num_stages} must be between 1 and the {num_layers} layers"
        )
    base, extra = divmod(num_layers, num_stages)
    bounds, start = [], 0
    for stage in range(num_stages):
        end = start + base + (1 if stage < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


WHOLE_MODEL = PPStage()  # no pipeline parallelism: one stage owns every layer
