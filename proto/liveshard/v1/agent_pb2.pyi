from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PodStatus(_message.Message):
    __slots__ = ("members", "unanswered")
    class UnansweredEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    UNANSWERED_FIELD_NUMBER: _ClassVar[int]
    members: _containers.RepeatedCompositeFieldContainer[AgentStatus]
    unanswered: _containers.ScalarMap[str, str]
    def __init__(self, members: _Optional[_Iterable[_Union[AgentStatus, _Mapping]]] = ..., unanswered: _Optional[_Mapping[str, str]] = ...) -> None: ...

class Layout(_message.Message):
    __slots__ = ("dp", "tp", "pp", "ep", "zero", "pp_layers", "members", "mirror")
    DP_FIELD_NUMBER: _ClassVar[int]
    TP_FIELD_NUMBER: _ClassVar[int]
    PP_FIELD_NUMBER: _ClassVar[int]
    EP_FIELD_NUMBER: _ClassVar[int]
    ZERO_FIELD_NUMBER: _ClassVar[int]
    PP_LAYERS_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    MIRROR_FIELD_NUMBER: _ClassVar[int]
    dp: int
    tp: int
    pp: int
    ep: int
    zero: int
    pp_layers: _containers.RepeatedScalarFieldContainer[int]
    members: _containers.RepeatedScalarFieldContainer[str]
    mirror: bool
    def __init__(self, dp: _Optional[int] = ..., tp: _Optional[int] = ..., pp: _Optional[int] = ..., ep: _Optional[int] = ..., zero: _Optional[int] = ..., pp_layers: _Optional[_Iterable[int]] = ..., members: _Optional[_Iterable[str]] = ..., mirror: _Optional[bool] = ...) -> None: ...

class StoreAddress(_message.Message):
    __slots__ = ("host", "port")
    HOST_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    host: str
    port: int
    def __init__(self, host: _Optional[str] = ..., port: _Optional[int] = ...) -> None: ...

class Deadlines(_message.Message):
    __slots__ = ("op_seconds", "switch_seconds", "prepare_seconds")
    OP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SWITCH_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PREPARE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    op_seconds: float
    switch_seconds: float
    prepare_seconds: float
    def __init__(self, op_seconds: _Optional[float] = ..., switch_seconds: _Optional[float] = ..., prepare_seconds: _Optional[float] = ...) -> None: ...

class GetStatusRequest(_message.Message):
    __slots__ = ("omit_layout",)
    OMIT_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    omit_layout: bool
    def __init__(self, omit_layout: _Optional[bool] = ...) -> None: ...

class WatchStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HostStoreRequest(_message.Message):
    __slots__ = ("epoch",)
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    def __init__(self, epoch: _Optional[int] = ...) -> None: ...

class HostStoreResponse(_message.Message):
    __slots__ = ("address",)
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    address: StoreAddress
    def __init__(self, address: _Optional[_Union[StoreAddress, _Mapping]] = ...) -> None: ...

class PrepareRequest(_message.Message):
    __slots__ = ("epoch", "store", "to", "lost", "budget_bytes", "deadlines", "at_step", "restore_from", "pods")
    class PodsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    STORE_FIELD_NUMBER: _ClassVar[int]
    FROM_FIELD_NUMBER: _ClassVar[int]
    TO_FIELD_NUMBER: _ClassVar[int]
    LOST_FIELD_NUMBER: _ClassVar[int]
    BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    DEADLINES_FIELD_NUMBER: _ClassVar[int]
    AT_STEP_FIELD_NUMBER: _ClassVar[int]
    RESTORE_FROM_FIELD_NUMBER: _ClassVar[int]
    PODS_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    store: StoreAddress
    to: Layout
    lost: _containers.RepeatedScalarFieldContainer[str]
    budget_bytes: int
    deadlines: Deadlines
    at_step: int
    restore_from: str
    pods: _containers.ScalarMap[str, str]
    def __init__(self, epoch: _Optional[int] = ..., store: _Optional[_Union[StoreAddress, _Mapping]] = ..., to: _Optional[_Union[Layout, _Mapping]] = ..., lost: _Optional[_Iterable[str]] = ..., budget_bytes: _Optional[int] = ..., deadlines: _Optional[_Union[Deadlines, _Mapping]] = ..., at_step: _Optional[int] = ..., restore_from: _Optional[str] = ..., pods: _Optional[_Mapping[str, str]] = ..., **kwargs) -> None: ...

class PrepareResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SwitchRequest(_message.Message):
    __slots__ = ("epoch", "at_step")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    AT_STEP_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    at_step: int
    def __init__(self, epoch: _Optional[int] = ..., at_step: _Optional[int] = ...) -> None: ...

class SwitchResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("epoch", "queue_only")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    QUEUE_ONLY_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    queue_only: bool
    def __init__(self, epoch: _Optional[int] = ..., queue_only: _Optional[bool] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CheckpointRequest(_message.Message):
    __slots__ = ("number", "path", "at_step", "export_to")
    NUMBER_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    AT_STEP_FIELD_NUMBER: _ClassVar[int]
    EXPORT_TO_FIELD_NUMBER: _ClassVar[int]
    number: int
    path: str
    at_step: int
    export_to: str
    def __init__(self, number: _Optional[int] = ..., path: _Optional[str] = ..., at_step: _Optional[int] = ..., export_to: _Optional[str] = ...) -> None: ...

class CheckpointResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("saved", "discard")
    SAVED_FIELD_NUMBER: _ClassVar[int]
    DISCARD_FIELD_NUMBER: _ClassVar[int]
    saved: int
    discard: bool
    def __init__(self, saved: _Optional[int] = ..., discard: _Optional[bool] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RotateCertificateRequest(_message.Message):
    __slots__ = ("cert", "key", "ca")
    CERT_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    CA_FIELD_NUMBER: _ClassVar[int]
    cert: bytes
    key: bytes
    ca: bytes
    def __init__(self, cert: _Optional[bytes] = ..., key: _Optional[bytes] = ..., ca: _Optional[bytes] = ...) -> None: ...

class RotateCertificateResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class AgentStatus(_message.Message):
    __slots__ = ("member", "phase", "ready", "epoch", "step", "layout", "loss", "pending", "last_switch", "last_checkpoint", "message", "terminating", "steps", "samples", "failed_checkpoint", "costs", "serving_certificate", "state_bytes", "mirrored_bytes", "exchange_seconds")
    class Phase(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        PHASE_UNSPECIFIED: _ClassVar[AgentStatus.Phase]
        STARTING: _ClassVar[AgentStatus.Phase]
        STANDBY: _ClassVar[AgentStatus.Phase]
        JOINING: _ClassVar[AgentStatus.Phase]
        TRAINING: _ClassVar[AgentStatus.Phase]
        DONE: _ClassVar[AgentStatus.Phase]
        FAILED: _ClassVar[AgentStatus.Phase]
        BROKEN: _ClassVar[AgentStatus.Phase]
    PHASE_UNSPECIFIED: AgentStatus.Phase
    STARTING: AgentStatus.Phase
    STANDBY: AgentStatus.Phase
    JOINING: AgentStatus.Phase
    TRAINING: AgentStatus.Phase
    DONE: AgentStatus.Phase
    FAILED: AgentStatus.Phase
    BROKEN: AgentStatus.Phase
    MEMBER_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    PENDING_FIELD_NUMBER: _ClassVar[int]
    LAST_SWITCH_FIELD_NUMBER: _ClassVar[int]
    LAST_CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    TERMINATING_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    FAILED_CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    COSTS_FIELD_NUMBER: _ClassVar[int]
    SERVING_CERTIFICATE_FIELD_NUMBER: _ClassVar[int]
    STATE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MIRRORED_BYTES_FIELD_NUMBER: _ClassVar[int]
    EXCHANGE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    member: str
    phase: AgentStatus.Phase
    ready: bool
    epoch: int
    step: int
    layout: Layout
    loss: float
    pending: Pending
    last_switch: SwitchSummary
    last_checkpoint: CheckpointSummary
    message: str
    terminating: bool
    steps: int
    samples: int
    failed_checkpoint: CheckpointSummary
    costs: Costs
    serving_certificate: str
    state_bytes: int
    mirrored_bytes: int
    exchange_seconds: float
    def __init__(self, member: _Optional[str] = ..., phase: _Optional[_Union[AgentStatus.Phase, str]] = ..., ready: _Optional[bool] = ..., epoch: _Optional[int] = ..., step: _Optional[int] = ..., layout: _Optional[_Union[Layout, _Mapping]] = ..., loss: _Optional[float] = ..., pending: _Optional[_Union[Pending, _Mapping]] = ..., last_switch: _Optional[_Union[SwitchSummary, _Mapping]] = ..., last_checkpoint: _Optional[_Union[CheckpointSummary, _Mapping]] = ..., message: _Optional[str] = ..., terminating: _Optional[bool] = ..., steps: _Optional[int] = ..., samples: _Optional[int] = ..., failed_checkpoint: _Optional[_Union[CheckpointSummary, _Mapping]] = ..., costs: _Optional[_Union[Costs, _Mapping]] = ..., serving_certificate: _Optional[str] = ..., state_bytes: _Optional[int] = ..., mirrored_bytes: _Optional[int] = ..., exchange_seconds: _Optional[float] = ...) -> None: ...

class Costs(_message.Message):
    __slots__ = ("layer_seconds", "first_seconds", "last_seconds", "steps", "imbalance", "stage_seconds")
    LAYER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    FIRST_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LAST_SECONDS_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    IMBALANCE_FIELD_NUMBER: _ClassVar[int]
    STAGE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    layer_seconds: _containers.RepeatedScalarFieldContainer[float]
    first_seconds: float
    last_seconds: float
    steps: int
    imbalance: float
    stage_seconds: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, layer_seconds: _Optional[_Iterable[float]] = ..., first_seconds: _Optional[float] = ..., last_seconds: _Optional[float] = ..., steps: _Optional[int] = ..., imbalance: _Optional[float] = ..., stage_seconds: _Optional[_Iterable[float]] = ...) -> None: ...

class Pending(_message.Message):
    __slots__ = ("epoch", "state", "at_step", "reason", "dropping")
    class State(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        STATE_UNSPECIFIED: _ClassVar[Pending.State]
        PREPARING: _ClassVar[Pending.State]
        PREPARED: _ClassVar[Pending.State]
        FAILED: _ClassVar[Pending.State]
        UNDECIDED: _ClassVar[Pending.State]
    STATE_UNSPECIFIED: Pending.State
    PREPARING: Pending.State
    PREPARED: Pending.State
    FAILED: Pending.State
    UNDECIDED: Pending.State
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    AT_STEP_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    DROPPING_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    state: Pending.State
    at_step: int
    reason: str
    dropping: bool
    def __init__(self, epoch: _Optional[int] = ..., state: _Optional[_Union[Pending.State, str]] = ..., at_step: _Optional[int] = ..., reason: _Optional[str] = ..., dropping: _Optional[bool] = ...) -> None: ...

class SwitchSummary(_message.Message):
    __slots__ = ("epoch", "step", "result", "cause", "reason", "to", "pause_seconds", "prepare_seconds", "network_bytes")
    class Result(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        RESULT_UNSPECIFIED: _ClassVar[SwitchSummary.Result]
        COMMITTED: _ClassVar[SwitchSummary.Result]
        ABORTED: _ClassVar[SwitchSummary.Result]
    RESULT_UNSPECIFIED: SwitchSummary.Result
    COMMITTED: SwitchSummary.Result
    ABORTED: SwitchSummary.Result
    class Cause(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        CAUSE_UNSPECIFIED: _ClassVar[SwitchSummary.Cause]
        PEER_FAILED: _ClassVar[SwitchSummary.Cause]
        DEADLINE_PASSED: _ClassVar[SwitchSummary.Cause]
        VOTE_NO: _ClassVar[SwitchSummary.Cause]
        CHECKSUM_MISMATCH: _ClassVar[SwitchSummary.Cause]
        VOTE_INCOMPLETE: _ClassVar[SwitchSummary.Cause]
        PLAN_MISMATCH: _ClassVar[SwitchSummary.Cause]
        NO_COMMON_STATE: _ClassVar[SwitchSummary.Cause]
        NO_SURVIVING_COPY: _ClassVar[SwitchSummary.Cause]
    CAUSE_UNSPECIFIED: SwitchSummary.Cause
    PEER_FAILED: SwitchSummary.Cause
    DEADLINE_PASSED: SwitchSummary.Cause
    VOTE_NO: SwitchSummary.Cause
    CHECKSUM_MISMATCH: SwitchSummary.Cause
    VOTE_INCOMPLETE: SwitchSummary.Cause
    PLAN_MISMATCH: SwitchSummary.Cause
    NO_COMMON_STATE: SwitchSummary.Cause
    NO_SURVIVING_COPY: SwitchSummary.Cause
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    CAUSE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    FROM_FIELD_NUMBER: _ClassVar[int]
    TO_FIELD_NUMBER: _ClassVar[int]
    PAUSE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PREPARE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    NETWORK_BYTES_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    step: int
    result: SwitchSummary.Result
    cause: SwitchSummary.Cause
    reason: str
    to: str
    pause_seconds: float
    prepare_seconds: float
    network_bytes: int
    def __init__(self, epoch: _Optional[int] = ..., step: _Optional[int] = ..., result: _Optional[_Union[SwitchSummary.Result, str]] = ..., cause: _Optional[_Union[SwitchSummary.Cause, str]] = ..., reason: _Optional[str] = ..., to: _Optional[str] = ..., pause_seconds: _Optional[float] = ..., prepare_seconds: _Optional[float] = ..., network_bytes: _Optional[int] = ..., **kwargs) -> None: ...

class CheckpointSummary(_message.Message):
    __slots__ = ("number", "step", "path", "seconds", "exported_to", "export_error", "error")
    NUMBER_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    EXPORTED_TO_FIELD_NUMBER: _ClassVar[int]
    EXPORT_ERROR_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    number: int
    step: int
    path: str
    seconds: float
    exported_to: str
    export_error: str
    error: str
    def __init__(self, number: _Optional[int] = ..., step: _Optional[int] = ..., path: _Optional[str] = ..., seconds: _Optional[float] = ..., exported_to: _Optional[str] = ..., export_error: _Optional[str] = ..., error: _Optional[str] = ...) -> None: ...
