/* A small device all_reduce's host steps in C: rankwise's glue between the API, the group,
 * the NCCL engine and its watchdog, run once per call on a GPU training loop's hot path.
 * Optional: without it the same steps run in Python (api.collectives._device_all_reduce,
 * ProcessGroup.begin, TorchEngine.hot_all_reduce's closure, CallLog.call_done), with the
 * same results; tests/test_hotcall.py runs both and compares them field by field.
 *
 * Why C: each step is a few attribute reads and stores, and the interpreter's dispatch
 * of ~240 bytecodes over six frames was half of rankwise's own host time per call, the
 * largest part left over a fake ProcessGroupNCCL (docs/gpu.md, "The glue in C": 29.2 k
 * -> 19.1 k instructions per blocking call, the fake's 4.9 k included).
 *
 * WorkWait(...)(call, p): the CUDA stream order (DeviceWaits._order_by_work_wait), also
 * what an async call's Work.wait() ends in.
 * Enqueue(...)(call, then) -> Pending: the engine's part (TorchEngine.hot_all_reduce).
 * AllReduce(...)(site, async_op, tensor) -> None | Work | NotImplemented: begin, the
 * engine's part, call_done; NotImplemented (nothing done) where the Python path must
 * run (a failure known to the router before the call: begin's own path raises it).
 * Front(...)(tensor, op, group, async_op) -> None | Work | NotImplemented: all_reduce's
 * own checks of a kept view's call, then its AllReduce; NotImplemented (nothing done)
 * for any other call: all_reduce's Python checks run.
 * What either does not do itself it hands to the Python functions it was given: the
 * watchdog's appended tail, the stream order, the ring check, a failed call's report. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <time.h>

/* ---- clocks: time.time() and time.monotonic(), as CPython makes their floats ------- */

static double
seconds_of(const struct timespec *ts)
{
    long long ns = (long long)ts->tv_sec * 1000000000LL + ts->tv_nsec;
    if (ns % 1000000000LL == 0)
        return (double)(ns / 1000000000LL);
    return (double)ns / 1e9;
}

static double
wall_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return seconds_of(&ts);
}

static double
monotonic_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return seconds_of(&ts);
}

/* ---- slots of the per-call records (engines.base.Call), at their offsets ------------ */

/* The offset of cls's object slot `name` (a member descriptor), -1 where it has none. */
static Py_ssize_t
slot_offset(PyTypeObject *cls, const char *name)
{
    PyObject *descr = PyDict_GetItemString(cls->tp_dict, name); /* borrowed */
    if (descr == NULL || Py_TYPE(descr) != &PyMemberDescr_Type)
        return -1;
    PyMemberDef *def = ((PyMemberDescrObject *)descr)->d_member;
    if (def->type != T_OBJECT_EX || (def->flags & READONLY))
        return -1;
    return def->offset;
}

/* obj.<slot at off> = value (a new reference taken); the old value dropped last. */
static void
slot_store(PyObject *obj, Py_ssize_t off, PyObject *value)
{
    PyObject **at = (PyObject **)((char *)obj + off);
    PyObject *old = *at;
    Py_INCREF(value);
    *at = value;
    Py_XDECREF(old);
}

/* ---- the module's three callable types, alike but for their fields ----------------- */

static void
gc_dealloc(PyObject *self)
{
    PyObject_GC_UnTrack(self);
    Py_TYPE(self)->tp_clear(self);
    Py_TYPE(self)->tp_free(self);
}

/* A GC-tracked type called by vectorcall: its <prefix>_new, _traverse and _clear. */
#define CALLABLE_TYPE(var, name, ctype, prefix, doc)                                        \
    static PyTypeObject var = {                                                             \
        PyVarObject_HEAD_INIT(NULL, 0)                                                      \
        .tp_name = name,                                                                    \
        .tp_basicsize = sizeof(ctype),                                                      \
        .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,   \
        .tp_doc = doc,                                                                      \
        .tp_new = prefix##_new,                                                             \
        .tp_traverse = prefix##_traverse,                                                   \
        .tp_clear = prefix##_clear,                                                         \
        .tp_dealloc = gc_dealloc,                                                           \
        .tp_call = PyVectorcall_Call,                                                       \
        .tp_vectorcall_offset = offsetof(ctype, vectorcall),                                \
    }

/* ---- plain attributes of long-lived objects, read in their __dict__ ------------------ */

/* An object whose attributes the hot path reads and writes on every call (the group's
 * seq, the watchdog's failed, ...). A generic getattr looks the name up on the type
 * first, then in the instance: ~250 instructions; its __dict__ alone, held here, ~50.
 * Only where that is what getattr would find: the names have no data descriptor on the
 * type (checked once, at construction), and the object still has that dict (checked on
 * each use: a dict materialized once stays the object's own). Otherwise: getattr. */
typedef struct {
    PyObject *obj;  /* strong */
    PyObject *dict; /* strong; NULL: generic access only */
} Attrs;

static int
attrs_init(Attrs *a, PyObject *obj, const char *const *names)
{
    Py_INCREF(obj);
    a->obj = obj;
    a->dict = NULL;
    for (const char *const *n = names; *n != NULL; n++) {
        PyObject *name = PyUnicode_InternFromString(*n);
        if (name == NULL)
            return -1;
        PyObject *descr = _PyType_Lookup(Py_TYPE(obj), name); /* borrowed */
        Py_DECREF(name);
        if (descr != NULL && Py_TYPE(descr)->tp_descr_set != NULL)
            return 0; /* a property or a slot: getattr's business */
    }
    PyObject **at = _PyObject_GetDictPtr(obj);
    if (at == NULL || Py_TYPE(obj)->tp_getattro != PyObject_GenericGetAttr
        || Py_TYPE(obj)->tp_setattro != PyObject_GenericSetAttr)
        return 0;
    PyObject *dict = PyObject_GenericGetDict(obj, NULL);
    if (dict == NULL)
        return -1;
    a->dict = dict;
    return 0;
}

static inline PyObject *
attrs_dict(const Attrs *a)
{
    if (a->dict == NULL)
        return NULL;
    PyObject **at = _PyObject_GetDictPtr(a->obj);
    return at != NULL && *at == a->dict ? a->dict : NULL;
}

/* obj.name, a new reference */
static PyObject *
attrs_get(const Attrs *a, PyObject *name)
{
    PyObject *dict = attrs_dict(a);
    if (dict != NULL) {
        PyObject *v = PyDict_GetItemWithError(dict, name); /* borrowed */
        if (v != NULL) {
            Py_INCREF(v);
            return v;
        }
        if (PyErr_Occurred())
            return NULL;
    }
    return PyObject_GetAttr(a->obj, name);
}

/* obj.name is None: 1, 0, or -1 with an exception set */
static int
attrs_is_none(const Attrs *a, PyObject *name)
{
    PyObject *v = attrs_get(a, name);
    if (v == NULL)
        return -1;
    int none = v == Py_None;
    Py_DECREF(v);
    return none;
}

static int
attrs_set(const Attrs *a, PyObject *name, PyObject *v)
{
    PyObject *dict = attrs_dict(a);
    if (dict != NULL)
        return PyDict_SetItem(dict, name, v);
    return PyObject_SetAttr(a->obj, name, v);
}

#define ATTRS_VISIT(a) do { Py_VISIT((a).obj); Py_VISIT((a).dict); } while (0)
#define ATTRS_CLEAR(a) do { Py_CLEAR((a).obj); Py_CLEAR((a).dict); } while (0)

/* ---- Enqueue: TorchEngine.hot_all_reduce's hot(call, then) ----------------------------- */

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *allreduce;   /* the engine's pg.allreduce */
    Attrs watchdog;        /* failed, due_at */
    PyObject *tensors, *opts, *check, *name, *clock, *ordered;
    PyObject *append;      /* watchdog.records.append */
    PyObject *new_pending; /* watchdog.new_pending */
    PyObject *holders;     /* streams.holders: a dict by thread id */
    PyObject *order;       /* the engine's DeviceWaits.order (a WorkWait: called here) */
    PyObject *after;       /* the ring check's after */
    PyTypeObject *call_type;
    Py_ssize_t off_started, off_enqueued, off_engine;
    double grace;
    int monotonic; /* clock is time.monotonic: read here */
} Enqueue;

static PyTypeObject Enqueue_Type;

static PyObject *s_failed, *s_due_at, *s_before, *s_enqueued,
    *s_started, *s_engine, *s_appended, *s_pendings, *s_append, *s_seq, *s_timeout,
    *s_label, *s_doing, *s_finished, *s_last, *s_since, *s_tracer,
    *s_collective, *s_failure, *s_title, *s_error, *s_work, *s_wait, *one;

static int
raise_object(PyObject *exc)
{
    PyErr_SetObject((PyObject *)Py_TYPE(exc), exc);
    return -1;
}

/* The object slot at `off` of an instance of exactly `type` (a new reference), else
 * getattr(obj, name). */
static PyObject *
slot_get(PyTypeObject *type, PyObject *obj, Py_ssize_t off, PyObject *name)
{
    if (off >= 0 && Py_TYPE(obj) == type) {
        PyObject *v = *(PyObject **)((char *)obj + off);
        if (v != NULL) {
            Py_INCREF(v);
            return v;
        }
    }
    return PyObject_GetAttr(obj, name);
}

/* The object slot at `off` of an instance of exactly `type`, borrowed; NULL where it
 * is another type or the slot is empty (no exception set). */
static PyObject *
slot_get_borrowed(PyTypeObject *type, PyObject *obj, Py_ssize_t off)
{
    if (off < 0 || Py_TYPE(obj) != type)
        return NULL;
    return *(PyObject **)((char *)obj + off);
}

/* obj.<slot at off> = v where obj is exactly `type`, else setattr(obj, name, v) */
static int
call_set(PyTypeObject *type, PyObject *call, Py_ssize_t off, PyObject *name, PyObject *v)
{
    if (off >= 0 && Py_TYPE(call) == type) {
        slot_store(call, off, v);
        return 0;
    }
    return PyObject_SetAttr(call, name, v);
}

/* ---- WorkWait: DeviceWaits._order_by_work_wait ------------------------------------ */

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *order_failed; /* DeviceWaits.order_failed: maps the wait's error */
    PyTypeObject *pending_type;
    Py_ssize_t off_error, off_work;
} WorkWait;

static PyTypeObject WorkWait_Type;

/* Raise `failure` for `err` as ``raise failure from None`` in err's except clause would
 * (err itself: as it is); steals neither. */
static void
raise_mapped(PyObject *failure, PyObject *err)
{
    if (failure == err) {
        raise_object(err);
        return;
    }
    PyException_SetCause(failure, NULL); /* from None */
    Py_INCREF(err);
    PyException_SetContext(failure, err);
    Py_INCREF(failure);
    PyErr_Restore(Py_NewRef((PyObject *)Py_TYPE(failure)), failure,
                  PyException_GetTraceback(failure));
}

/* The settled record's error or the work's own wait() (a stream wait), an error of
 * either mapped by order_failed; 0 or -1 */
static int
work_wait_run(WorkWait *w, PyObject *call, PyObject *p)
{
    PyObject *error = slot_get(w->pending_type, p, w->off_error, s_error);
    if (error == NULL)
        return -1;
    if (error != Py_None) { /* the watchdog's verdict, mapped as the wait's would be */
        PyObject *args[2] = {call, error};
        PyObject *failure = PyObject_Vectorcall(w->order_failed, args, 2, NULL);
        if (failure != NULL) {
            raise_mapped(failure, error);
            Py_DECREF(failure);
        }
        Py_DECREF(error);
        return -1;
    }
    Py_DECREF(error);
    PyObject *work = slot_get(w->pending_type, p, w->off_work, s_work);
    if (work == NULL)
        return -1;
    PyObject *r = PyObject_CallMethodNoArgs(work, s_wait);
    Py_DECREF(work);
    if (r != NULL) {
        Py_DECREF(r);
        return 0;
    }
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    if (tb != NULL)
        PyException_SetTraceback(value, tb);
    PyObject *args[2] = {call, value};
    PyObject *failure = PyObject_Vectorcall(w->order_failed, args, 2, NULL);
    if (failure == NULL) {
        Py_XDECREF(type);
        Py_XDECREF(value);
        Py_XDECREF(tb);
        return -1;
    }
    if (failure == value) {
        Py_DECREF(failure);
        PyErr_Restore(type, value, tb);
        return -1;
    }
    raise_mapped(failure, value);
    Py_DECREF(failure);
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(tb);
    return -1;
}

static PyObject *
work_wait_vectorcall(PyObject *self, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    if (PyVectorcall_NARGS(nargsf) != 2 || (kwnames != NULL && PyTuple_GET_SIZE(kwnames))) {
        PyErr_SetString(PyExc_TypeError, "order(call, p) takes 2 positional arguments");
        return NULL;
    }
    if (work_wait_run((WorkWait *)self, args[0], args[1]) < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *
work_wait_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    PyObject *order_failed, *pending_type;
    static char *kwlist[] = {"order_failed", "pending_type", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO!:WorkWait", kwlist, &order_failed,
                                     &PyType_Type, &pending_type))
        return NULL;
    WorkWait *w = (WorkWait *)type->tp_alloc(type, 0);
    if (w == NULL)
        return NULL;
    w->vectorcall = work_wait_vectorcall;
    Py_INCREF(order_failed);
    w->order_failed = order_failed;
    Py_INCREF(pending_type);
    w->pending_type = (PyTypeObject *)pending_type;
    w->off_error = slot_offset(w->pending_type, "error");
    w->off_work = slot_offset(w->pending_type, "work");
    return (PyObject *)w;
}

static int
work_wait_traverse(PyObject *self, visitproc visit, void *arg)
{
    Py_VISIT(((WorkWait *)self)->order_failed);
    Py_VISIT(((WorkWait *)self)->pending_type);
    return 0;
}

static int
work_wait_clear(PyObject *self)
{
    Py_CLEAR(((WorkWait *)self)->order_failed);
    Py_CLEAR(((WorkWait *)self)->pending_type);
    return 0;
}

CALLABLE_TYPE(WorkWait_Type, "rankwise._hotcall.WorkWait", WorkWait, work_wait,
              "order(call, p): DeviceWaits._order_by_work_wait, in C");

/* The closure's steps; a new reference to the record, NULL with an exception set. */
static PyObject *
enqueue_run(Enqueue *e, PyObject *call, int then, int after)
{
    PyObject *failed = attrs_get(&e->watchdog, s_failed);
    if (failed == NULL)
        return NULL;
    if (failed != Py_None) {
        raise_object(failed);
        Py_DECREF(failed);
        return NULL;
    }
    Py_DECREF(failed);
    if (e->check != Py_None) {
        PyObject *r = PyObject_CallMethodOneArg(e->check, s_before, call);
        if (r == NULL)
            return NULL;
        Py_DECREF(r);
    }
    PyObject *margs[2] = {e->tensors, e->opts};
    PyObject *work = PyObject_Vectorcall(e->allreduce, margs, 2, NULL);
    if (work == NULL)
        return NULL;
    PyObject *p = NULL, *start_obj = NULL;
    if (e->check != Py_None) {
        PyObject *r = PyObject_CallMethodNoArgs(e->check, s_enqueued);
        if (r == NULL)
            goto done;
        Py_DECREF(r);
    }
    /* who-is-where: the kernel's now (the call's start stands for the enqueue) */
    PyObject *started = slot_get(e->call_type, call, e->off_started, s_started);
    if (started == NULL)
        goto done;
    int bad = call_set(e->call_type, call, e->off_enqueued, s_enqueued, started);
    Py_DECREF(started);
    if (bad || call_set(e->call_type, call, e->off_engine, s_engine, e->name))
        goto done;
    double start;
    if (e->monotonic) {
        start = monotonic_now();
        start_obj = PyFloat_FromDouble(start);
    } else {
        start_obj = PyObject_CallNoArgs(e->clock);
        start = start_obj == NULL ? -1.0 : PyFloat_AsDouble(start_obj);
    }
    if (start_obj == NULL || (start == -1.0 && PyErr_Occurred()))
        goto done;
    PyObject *pargs[5] = {e->watchdog.obj, call, work, start_obj, e->ordered};
    p = PyObject_Vectorcall(e->new_pending, pargs, 5, NULL);
    if (p == NULL)
        goto done;
    PyObject *r = PyObject_CallOneArg(e->append, p);
    if (r == NULL)
        goto fail;
    Py_DECREF(r);
    /* Watchdog.watch's tail, only where it has work (Watchdog.appended) */
    int tail = attrs_is_none(&e->watchdog, s_failed);
    if (tail < 0)
        goto fail;
    tail = !tail;
    if (!tail) {
        PyObject *due = attrs_get(&e->watchdog, s_due_at);
        if (due == NULL)
            goto fail;
        double due_at = PyFloat_AsDouble(due);
        Py_DECREF(due);
        if (due_at == -1.0 && PyErr_Occurred())
            goto fail;
        tail = start + e->grace < due_at;
    }
    if (tail) {
        PyObject *args[3] = {e->watchdog.obj, p, start_obj};
        r = PyObject_VectorcallMethod(s_appended, args, 3 | PY_VECTORCALL_ARGUMENTS_OFFSET,
                                      NULL);
        if (r == NULL)
            goto fail;
        Py_DECREF(r);
    }
    if (then) {
        if (PyDict_GET_SIZE(e->holders) > 0) { /* an async call runs on some thread */
            PyObject *me = PyLong_FromUnsignedLong(PyThread_get_thread_ident());
            if (me == NULL)
                goto fail;
            PyObject *holder = PyDict_GetItemWithError(e->holders, me); /* borrowed */
            Py_DECREF(me);
            if (holder == NULL && PyErr_Occurred())
                goto fail;
            if (holder != NULL) {
                PyObject *pendings = PyObject_GetAttr(holder, s_pendings);
                if (pendings == NULL)
                    goto fail;
                r = PyObject_CallMethodOneArg(pendings, s_append, p);
                Py_DECREF(pendings);
                if (r == NULL)
                    goto fail;
                Py_DECREF(r);
            }
        }
        if (Py_TYPE(e->order) == &WorkWait_Type) {
            if (work_wait_run((WorkWait *)e->order, call, p) < 0)
                goto fail;
        } else {
            PyObject *oargs[2] = {call, p};
            r = PyObject_Vectorcall(e->order, oargs, 2, NULL);
            if (r == NULL)
                goto fail;
            Py_DECREF(r);
        }
        if (after) {
            r = PyObject_CallNoArgs(e->after);
            if (r == NULL)
                goto fail;
            Py_DECREF(r);
        }
    }
    goto done;
fail:
    Py_CLEAR(p);
done:
    Py_XDECREF(start_obj);
    Py_DECREF(work);
    return p;
}

static PyObject *
enqueue_vectorcall(PyObject *self, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    Py_ssize_t n = PyVectorcall_NARGS(nargsf);
    if (n != 2 || (kwnames != NULL && PyTuple_GET_SIZE(kwnames) > 0)) {
        PyErr_SetString(PyExc_TypeError, "hot(call, then) takes 2 positional arguments");
        return NULL;
    }
    int then = PyObject_IsTrue(args[1]);
    if (then < 0)
        return NULL;
    return enqueue_run((Enqueue *)self, args[0], then, 1);
}

static PyObject *
enqueue_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    Enqueue *e;
    PyObject *allreduce, *tensors, *opts, *watchdog, *check, *name, *clock, *ordered, *append,
        *new_pending, *holders, *order, *after, *call_type;
    double grace;
    int monotonic;
    static char *kwlist[] = {"allreduce", "tensors", "opts", "watchdog", "check", "name",
                             "clock", "monotonic", "ordered", "append", "new_pending",
                             "holders", "order", "after", "call_type", "grace",
                             NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOOOOOOpOOOO!OOO!d:Enqueue", kwlist,
                                     &allreduce, &tensors, &opts, &watchdog, &check, &name,
                                     &clock, &monotonic, &ordered, &append, &new_pending,
                                     &PyDict_Type, &holders, &order, &after,
                                     &PyType_Type, &call_type, &grace))
        return NULL;
    e = (Enqueue *)type->tp_alloc(type, 0);
    if (e == NULL)
        return NULL;
    e->vectorcall = enqueue_vectorcall;
    static const char *const watched[] = {"failed", "due_at", NULL};
    if (attrs_init(&e->watchdog, watchdog, watched) < 0) {
        Py_DECREF(e);
        return NULL;
    }
#define KEEP(f) (Py_INCREF(f), e->f = f)
    KEEP(allreduce); KEEP(tensors); KEEP(opts); KEEP(check); KEEP(name);
    KEEP(clock); KEEP(ordered); KEEP(append); KEEP(new_pending); KEEP(holders);
    KEEP(order); KEEP(after);
#undef KEEP
    Py_INCREF(call_type);
    e->call_type = (PyTypeObject *)call_type;
    e->off_started = slot_offset(e->call_type, "started");
    e->off_enqueued = slot_offset(e->call_type, "enqueued");
    e->off_engine = slot_offset(e->call_type, "engine");
    e->grace = grace;
    e->monotonic = monotonic;
    return (PyObject *)e;
}

static int
enqueue_traverse(PyObject *self, visitproc visit, void *arg)
{
    Enqueue *e = (Enqueue *)self;
    Py_VISIT(e->allreduce); Py_VISIT(e->tensors); Py_VISIT(e->opts); ATTRS_VISIT(e->watchdog);
    Py_VISIT(e->check); Py_VISIT(e->name); Py_VISIT(e->clock); Py_VISIT(e->ordered);
    Py_VISIT(e->append); Py_VISIT(e->new_pending); Py_VISIT(e->holders);
    Py_VISIT(e->order); Py_VISIT(e->after); Py_VISIT(e->call_type);
    return 0;
}

static int
enqueue_clear(PyObject *self)
{
    Enqueue *e = (Enqueue *)self;
    Py_CLEAR(e->allreduce); Py_CLEAR(e->tensors); Py_CLEAR(e->opts); ATTRS_CLEAR(e->watchdog);
    Py_CLEAR(e->check); Py_CLEAR(e->name); Py_CLEAR(e->clock); Py_CLEAR(e->ordered);
    Py_CLEAR(e->append); Py_CLEAR(e->new_pending); Py_CLEAR(e->holders);
    Py_CLEAR(e->order); Py_CLEAR(e->after); Py_CLEAR(e->call_type);
    return 0;
}

CALLABLE_TYPE(Enqueue_Type, "rankwise._hotcall.Enqueue", Enqueue, enqueue,
              "hot(call, then): TorchEngine.hot_all_reduce's closure, in C");

/* ---- AllReduce: _device_all_reduce with begin and call_done ------------------------- */

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    Attrs group;  /* seq, timeout */
    Attrs comm;   /* doing, tracer */
    Attrs router; /* failure */
    Attrs calls;  /* the comm's CallLog: _last */
    Attrs idle;   /* the CallLog's idle Activity: since */
    PyObject *history_append, *fp, *dtype, *rop, *shape;
    PyObject *label_var, *new_call, *enqueue, *failed;
    PyObject *ended;         /* core.work.new_ended(error, result, description, device) */
    PyObject *register_call; /* router.register_call where the engine is framed, else None */
    PyObject *gid;
    PyTypeObject *call_type;
    Py_ssize_t off_label, off_finished;
} AllReduce;

static PyTypeObject AllReduce_Type;

/* CallLog.call_done(call), for calls that end here; -1 with an exception set */
static int
call_done(AllReduce *a, PyObject *call)
{
    PyObject *now = PyFloat_FromDouble(wall_now());
    if (now == NULL)
        return -1;
    int bad = call_set(a->call_type, call, a->off_finished, s_finished, now)
        || attrs_set(&a->calls, s_last, call) || attrs_set(&a->idle, s_since, now)
        || attrs_set(&a->comm, s_doing, a->idle.obj);
    Py_DECREF(now);
    if (bad)
        return -1;
    PyObject *tracer = attrs_get(&a->comm, s_tracer);
    if (tracer == NULL)
        return -1;
    if (tracer != Py_None) {
        PyObject *args[3] = {tracer, a->group.obj, call};
        PyObject *r = PyObject_VectorcallMethod(s_collective, args,
                                                3 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
        Py_DECREF(tracer);
        if (r == NULL)
            return -1;
        Py_DECREF(r);
        return 0;
    }
    Py_DECREF(tracer);
    return 0;
}

/* ProcessGroup.begin for a call whose engine moves no frames; NULL with an exception
 * set, or NULL without one: the router knows a failure, begin's Python path must run */
static PyObject *
begin(AllReduce *a, PyObject *site)
{
    int none = attrs_is_none(&a->router, s_failure);
    if (none <= 0)
        return NULL;
    PyObject *seq = attrs_get(&a->group, s_seq);
    if (seq == NULL)
        return NULL;
    PyObject *next = PyNumber_Add(seq, one);
    Py_DECREF(seq);
    if (next == NULL)
        return NULL;
    if (attrs_set(&a->group, s_seq, next) < 0) {
        Py_DECREF(next);
        return NULL;
    }
    PyObject *timeout = attrs_get(&a->group, s_timeout);
    double t = timeout == NULL ? -1.0 : PyFloat_AsDouble(timeout);
    Py_XDECREF(timeout);
    if (t == -1.0 && PyErr_Occurred()) {
        Py_DECREF(next);
        return NULL;
    }
    double now = wall_now();
    PyObject *deadline = PyFloat_FromDouble(monotonic_now() + t);
    PyObject *started = PyFloat_FromDouble(now);
    PyObject *call = NULL;
    if (deadline != NULL && started != NULL) {
        PyObject *args[9] = {a->group.obj, next, a->fp, site, a->dtype, a->rop, deadline,
                             started, a->shape};
        call = PyObject_Vectorcall(a->new_call, args, 9, NULL);
    }
    Py_XDECREF(deadline);
    Py_XDECREF(started);
    if (call == NULL) {
        Py_DECREF(next);
        return NULL;
    }
    PyObject *label;
    if (PyContextVar_Get(a->label_var, NULL, &label) < 0)
        goto fail;
    if (label != NULL) {
        int bad = label != Py_None
            && call_set(a->call_type, call, a->off_label, s_label, label);
        Py_DECREF(label);
        if (bad)
            goto fail;
    }
    PyObject *r = PyObject_CallOneArg(a->history_append, call);
    if (r == NULL)
        goto fail;
    Py_DECREF(r);
    if (a->register_call != Py_None) {
        PyObject *rargs[3] = {a->gid, next, a->fp};
        r = PyObject_Vectorcall(a->register_call, rargs, 3, NULL);
        if (r == NULL)
            goto fail;
        Py_DECREF(r);
    }
    Py_DECREF(next);
    return call;
fail:
    Py_DECREF(next);
    Py_DECREF(call);
    return NULL;
}

static PyObject *
allreduce_vectorcall(PyObject *self, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    AllReduce *a = (AllReduce *)self;
    if (PyVectorcall_NARGS(nargsf) != 3 || (kwnames != NULL && PyTuple_GET_SIZE(kwnames))) {
        PyErr_SetString(PyExc_TypeError, "call(site, async_op, tensor) takes 3 positional "
                                         "arguments");
        return NULL;
    }
    PyObject *site = args[0], *tensor = args[2];
    int async_op = PyObject_IsTrue(args[1]);
    if (async_op < 0)
        return NULL;
    PyObject *call = begin(a, site);
    if (call == NULL) {
        if (PyErr_Occurred())
            return NULL;
        Py_RETURN_NOTIMPLEMENTED;
    }
    PyObject *result = NULL;
    if (attrs_set(&a->comm, s_doing, call) < 0)
        goto out;
    PyObject *p;
    if (Py_TYPE(a->enqueue) == &Enqueue_Type) {
        /* the ring check's after(), whose one read is the router's failure: read here */
        p = enqueue_run((Enqueue *)a->enqueue, call, !async_op, 0);
        if (p != NULL && !async_op) {
            int none = attrs_is_none(&a->router, s_failure);
            PyObject *r = none ? NULL : PyObject_CallNoArgs(((Enqueue *)a->enqueue)->after);
            if (none < 0 || (!none && r == NULL))
                Py_CLEAR(p);
            Py_XDECREF(r);
        }
    } else {
        p = PyObject_CallFunctionObjArgs(a->enqueue, call, async_op ? Py_False : Py_True, NULL);
    }
    if (p == NULL) { /* the Python path's except clauses, and its call_done */
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
        PyErr_NormalizeException(&type, &value, &tb);
        if (tb != NULL)
            PyException_SetTraceback(value, tb);
        PyObject *fargs[5] = {a->comm.obj, call, value, tensor, async_op ? Py_True : Py_False};
        result = PyObject_Vectorcall(a->failed, fargs, 5, NULL);
        Py_XDECREF(type);
        Py_XDECREF(value);
        Py_XDECREF(tb);
        goto out;
    }
    if (call_done(a, call) < 0) {
        Py_DECREF(p);
        goto out;
    }
    if (!async_op) {
        Py_DECREF(p);
        result = Py_None;
        Py_INCREF(result);
        goto out;
    }
    PyObject *title = PyObject_GetAttr(call, s_title);
    PyObject *outputs = title == NULL ? NULL : PyList_New(1);
    if (outputs != NULL) {
        Py_INCREF(tensor);
        PyList_SET_ITEM(outputs, 0, tensor);
        PyObject *eargs[4] = {Py_None, outputs, title, p};
        result = PyObject_Vectorcall(a->ended, eargs, 4, NULL);
    }
    Py_XDECREF(title);
    Py_XDECREF(outputs);
    Py_DECREF(p);
out:
    Py_DECREF(call);
    return result;
}

static PyObject *
allreduce_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    PyObject *group, *comm, *router, *calls, *idle, *history_append, *fp, *dtype, *rop,
        *shape, *label_var, *new_call, *enqueue, *failed, *ended, *register_call, *gid,
        *call_type;
    static char *kwlist[] = {"group", "comm", "router", "calls", "idle", "history_append",
                             "fp", "dtype", "rop", "shape", "label_var", "new_call",
                             "enqueue", "failed", "ended", "register_call", "gid",
                             "call_type", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOOOOOOOOOO!OOOOOOO!:AllReduce", kwlist,
                                     &group, &comm, &router, &calls, &idle, &history_append,
                                     &fp, &dtype, &rop, &shape, &PyContextVar_Type,
                                     &label_var, &new_call, &enqueue, &failed, &ended,
                                     &register_call, &gid, &PyType_Type, &call_type))
        return NULL;
    AllReduce *a = (AllReduce *)type->tp_alloc(type, 0);
    if (a == NULL)
        return NULL;
    a->vectorcall = allreduce_vectorcall;
    static const char *const group_names[] = {"seq", "timeout", "device_route", "engine",
                                              "queued", NULL};
    static const char *const comm_names[] = {"doing", "tracer", NULL};
    static const char *const router_names[] = {"failure", NULL};
    static const char *const calls_names[] = {"_last", NULL};
    static const char *const idle_names[] = {"since", NULL};
    if (attrs_init(&a->group, group, group_names) < 0
        || attrs_init(&a->comm, comm, comm_names) < 0
        || attrs_init(&a->router, router, router_names) < 0
        || attrs_init(&a->calls, calls, calls_names) < 0
        || attrs_init(&a->idle, idle, idle_names) < 0) {
        Py_DECREF(a);
        return NULL;
    }
#define KEEP(f) (Py_INCREF(f), a->f = f)
    KEEP(history_append); KEEP(fp);
    KEEP(dtype); KEEP(rop); KEEP(shape); KEEP(label_var); KEEP(new_call); KEEP(enqueue);
    KEEP(failed); KEEP(ended); KEEP(register_call); KEEP(gid);
#undef KEEP
    Py_INCREF(call_type);
    a->call_type = (PyTypeObject *)call_type;
    a->off_label = slot_offset(a->call_type, "label");
    a->off_finished = slot_offset(a->call_type, "finished");
    return (PyObject *)a;
}

static int
allreduce_traverse(PyObject *self, visitproc visit, void *arg)
{
    AllReduce *a = (AllReduce *)self;
    ATTRS_VISIT(a->group); ATTRS_VISIT(a->comm); ATTRS_VISIT(a->router);
    ATTRS_VISIT(a->calls); ATTRS_VISIT(a->idle); Py_VISIT(a->history_append);
    Py_VISIT(a->fp); Py_VISIT(a->dtype); Py_VISIT(a->rop);
    Py_VISIT(a->shape); Py_VISIT(a->label_var); Py_VISIT(a->new_call);
    Py_VISIT(a->enqueue); Py_VISIT(a->failed); Py_VISIT(a->ended); Py_VISIT(a->call_type);
    Py_VISIT(a->register_call); Py_VISIT(a->gid);
    return 0;
}

static int
allreduce_clear(PyObject *self)
{
    AllReduce *a = (AllReduce *)self;
    ATTRS_CLEAR(a->group); ATTRS_CLEAR(a->comm); ATTRS_CLEAR(a->router);
    ATTRS_CLEAR(a->calls); ATTRS_CLEAR(a->idle); Py_CLEAR(a->history_append);
    Py_CLEAR(a->fp); Py_CLEAR(a->dtype); Py_CLEAR(a->rop);
    Py_CLEAR(a->shape); Py_CLEAR(a->label_var); Py_CLEAR(a->new_call);
    Py_CLEAR(a->enqueue); Py_CLEAR(a->failed); Py_CLEAR(a->ended); Py_CLEAR(a->call_type);
    Py_CLEAR(a->register_call); Py_CLEAR(a->gid);
    return 0;
}

CALLABLE_TYPE(AllReduce_Type, "rankwise._hotcall.AllReduce", AllReduce, allreduce,
              "call(site, async_op, tensor): a kept view's device all_reduce, in C");

/* ---- Front: all_reduce's own checks for a kept view's call ------------------------- */

/* all_reduce(tensor, op, group=None, async_op) up to its AllReduce, for the case its
 * Python checks find: a torch.Tensor (exactly) whose kept view still holds (the checks
 * of TensorViews.view, in its order), a plain ReduceOp whose plan is bound to the
 * default group's device route with its steps in C, nothing queued, no profiler
 * recording. Anything else: NotImplemented, nothing done, and the Python checks run. */
typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *entries;           /* TensorViews' {id(t): (ref, ptr, shape, dtype, buf, memo)} */
    PyTypeObject *tensor_type;   /* torch.Tensor */
    PyTypeObject *rop_type;      /* ReduceOp */
    PyTypeObject *plan_type;     /* api.collectives.Plan */
    PyObject *world_globals;     /* api.world's module dict (its _world) */
    PyObject *thread_worlds;     /* api.world._thread_worlds: a dict by thread id */
    PyObject *profiling_globals; /* api.profiling's module dict (recording, on) */
    PyObject *capture;           /* identity.callsite.capture */
    Py_ssize_t off_code, off_factor, off_bound;
} Front;

static PyTypeObject Front_Type;
static PyObject *s_data_ptr, *s_shape, *s_dtype, *s_requires_grad, *s_is_contiguous,
    *s_world, *s_default_group, *s_device_route, *s_queued, *s_recording, *s_on, *two;

/* a profiler records now: api.profiling's ``recording() and on()``; -1 on error */
static int
profiling_on(Front *f)
{
    static PyObject *const *names[2] = {&s_recording, &s_on};
    for (int i = 0; i < 2; i++) {
        PyObject *fn = PyDict_GetItemWithError(f->profiling_globals, *names[i]);
        if (fn == NULL)
            return PyErr_Occurred() ? -1 : 0;
        PyObject *r = PyObject_CallNoArgs(fn);
        int on = r == NULL ? -1 : PyObject_IsTrue(r);
        Py_XDECREF(r);
        if (on <= 0)
            return on;
    }
    return 1;
}

/* TensorViews.view's hit: 1, 0 (not kept as it is now), -1 on error */
static int
view_holds(PyObject *t, PyObject *entry)
{
    if (!PyTuple_CheckExact(entry) || PyTuple_GET_SIZE(entry) != 6)
        return 0;
    PyObject *ref = PyTuple_GET_ITEM(entry, 0);
    if (!PyWeakref_CheckRef(ref))
        return 0;
#if PY_VERSION_HEX >= 0x030D0000 /* PyWeakref_GetObject is deprecated from 3.13 */
    PyObject *target;
    if (PyWeakref_GetRef(ref, &target) < 0)
        return -1;
    Py_XDECREF(target); /* compared as a pointer only: t is alive, held by our caller */
    if (target != t)
        return 0;
#else
    if (PyWeakref_GetObject(ref) != t)
        return 0;
#endif
    PyObject *v = PyObject_CallMethodNoArgs(t, s_data_ptr);
    int ok = v == NULL ? -1 : PyObject_RichCompareBool(v, PyTuple_GET_ITEM(entry, 1), Py_EQ);
    Py_XDECREF(v);
    if (ok <= 0)
        return ok;
    v = PyObject_GetAttr(t, s_shape);
    ok = v == NULL ? -1 : PyObject_RichCompareBool(v, PyTuple_GET_ITEM(entry, 2), Py_EQ);
    Py_XDECREF(v);
    if (ok <= 0)
        return ok;
    v = PyObject_GetAttr(t, s_dtype);
    if (v == NULL)
        return -1;
    ok = v == PyTuple_GET_ITEM(entry, 3);
    Py_DECREF(v);
    if (!ok)
        return 0;
    v = PyObject_GetAttr(t, s_requires_grad);
    ok = v == NULL ? -1 : PyObject_IsTrue(v);
    Py_XDECREF(v);
    if (ok != 0)
        return ok < 0 ? -1 : 0;
    v = PyObject_CallMethodNoArgs(t, s_is_contiguous);
    ok = v == NULL ? -1 : PyObject_IsTrue(v);
    Py_XDECREF(v);
    return ok;
}

/* the kept view's bound plan for op, its AllReduce (borrowed from bound, which is
 * returned as a new reference in *bound_out); NULL: none (an error set, or not) */
static PyObject *
bound_steps(Front *f, PyObject *t, PyObject *op, PyObject **bound_out)
{
    *bound_out = NULL;
    if (slot_get_borrowed(f->rop_type, op, f->off_factor) != Py_None)
        return NULL;
    PyObject *code = slot_get_borrowed(f->rop_type, op, f->off_code);
    PyObject *key = PyLong_FromVoidPtr(t);
    if (key == NULL || code == NULL) {
        Py_XDECREF(key);
        return NULL;
    }
    PyObject *entry = PyDict_GetItemWithError(f->entries, key); /* borrowed */
    Py_DECREF(key);
    if (entry == NULL)
        return NULL;
    /* the plan first (no torch call: a host engine's view has no such plan), then
     * whether the view still holds (a stale view's plan is never used) */
    if (!PyTuple_CheckExact(entry) || PyTuple_GET_SIZE(entry) != 6
        || !PyDict_CheckExact(PyTuple_GET_ITEM(entry, 5)))
        return NULL;
    PyObject *plan = PyDict_GetItemWithError(PyTuple_GET_ITEM(entry, 5), code);
    PyObject *bound = plan == NULL ? NULL : slot_get_borrowed(f->plan_type, plan,
                                                              f->off_bound);
    if (bound == NULL || !PyTuple_CheckExact(bound) || PyTuple_GET_SIZE(bound) != 5
        || Py_TYPE(PyTuple_GET_ITEM(bound, 4)) != &AllReduce_Type)
        return NULL;
    Py_INCREF(entry); /* the checks call torch: entry and bound stay ours meanwhile */
    Py_INCREF(bound);
    int holds = view_holds(t, entry);
    Py_DECREF(entry);
    if (holds <= 0) {
        Py_DECREF(bound);
        return NULL;
    }
    *bound_out = bound;
    return PyTuple_GET_ITEM(bound, 4);
}

static PyObject *
front_vectorcall(PyObject *self, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    Front *f = (Front *)self;
    if (PyVectorcall_NARGS(nargsf) != 4 || (kwnames != NULL && PyTuple_GET_SIZE(kwnames))) {
        PyErr_SetString(PyExc_TypeError, "front(tensor, op, group, async_op) takes 4 "
                                         "positional arguments");
        return NULL;
    }
    PyObject *t = args[0], *op = args[1];
    if (args[2] != Py_None || Py_TYPE(t) != f->tensor_type || Py_TYPE(op) != f->rop_type)
        Py_RETURN_NOTIMPLEMENTED;
    PyObject *bound, *result = NULL;
    AllReduce *a = (AllReduce *)bound_steps(f, t, op, &bound);
    if (a == NULL)
        goto fallback;
    /* resolve_group(None): this thread-rank's world, else the process's */
    PyObject *world = NULL;
    if (PyDict_GET_SIZE(f->thread_worlds) > 0) {
        PyObject *me = PyLong_FromUnsignedLong(PyThread_get_thread_ident());
        if (me == NULL)
            goto out;
        world = PyDict_GetItemWithError(f->thread_worlds, me);
        Py_DECREF(me);
        if (world == NULL && PyErr_Occurred())
            goto out;
    }
    if (world == NULL || world == Py_None) {
        world = PyDict_GetItemWithError(f->world_globals, s_world);
        if (world == NULL || world == Py_None)
            goto fallback;
    }
    PyObject *g = PyObject_GetAttr(world, s_default_group);
    if (g == NULL)
        goto out;
    int same = g == a->group.obj;
    Py_DECREF(g);
    if (!same)
        goto fallback;
    /* the plan's route is the group's, nothing is queued, no profiler records */
    PyObject *route = PyTuple_GET_ITEM(bound, 0);
    PyObject *v = attrs_get(&a->group, s_device_route);
    if (v == NULL)
        goto out;
    same = v == route;
    Py_DECREF(v);
    if (!same || !PyTuple_Check(route) || PyTuple_GET_SIZE(route) < 1)
        goto fallback;
    v = attrs_get(&a->group, s_engine);
    if (v == NULL)
        goto out;
    same = v == PyTuple_GET_ITEM(route, 0);
    Py_DECREF(v);
    int idle = same ? attrs_is_none(&a->group, s_queued) : 0;
    if (idle < 0)
        goto out;
    if (!idle)
        goto fallback;
    int on = profiling_on(f);
    if (on < 0)
        goto out;
    if (on)
        goto fallback;
    PyObject *site = PyObject_CallOneArg(f->capture, two);
    if (site == NULL)
        goto out;
    PyObject *cargs[3] = {site, args[3], t};
    result = allreduce_vectorcall((PyObject *)a, cargs, 3, NULL);
    Py_DECREF(site);
    goto out;
fallback:
    if (!PyErr_Occurred()) {
        result = Py_NotImplemented;
        Py_INCREF(result);
    }
out:
    Py_XDECREF(bound);
    return result;
}

static PyObject *
front_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    PyObject *entries, *tensor_type, *rop_type, *plan_type, *world_globals, *thread_worlds,
        *profiling_globals, *capture;
    static char *kwlist[] = {"entries", "tensor_type", "rop_type", "plan_type",
                             "world_globals", "thread_worlds", "profiling_globals",
                             "capture", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O!O!O!O!O!O!O!O:Front", kwlist,
                                     &PyDict_Type, &entries, &PyType_Type, &tensor_type,
                                     &PyType_Type, &rop_type, &PyType_Type, &plan_type,
                                     &PyDict_Type, &world_globals, &PyDict_Type,
                                     &thread_worlds, &PyDict_Type, &profiling_globals,
                                     &capture))
        return NULL;
    Front *f = (Front *)type->tp_alloc(type, 0);
    if (f == NULL)
        return NULL;
    f->vectorcall = front_vectorcall;
#define KEEP(x) (Py_INCREF(x), f->x = (void *)x)
    KEEP(entries); KEEP(tensor_type); KEEP(rop_type); KEEP(plan_type); KEEP(world_globals);
    KEEP(thread_worlds); KEEP(profiling_globals); KEEP(capture);
#undef KEEP
    f->off_code = slot_offset(f->rop_type, "code");
    f->off_factor = slot_offset(f->rop_type, "factor");
    f->off_bound = slot_offset(f->plan_type, "bound");
    if (f->off_code < 0 || f->off_factor < 0 || f->off_bound < 0) {
        Py_DECREF(f);
        PyErr_SetString(PyExc_TypeError, "Front: ReduceOp and Plan must have their slots");
        return NULL;
    }
    return (PyObject *)f;
}

static int
front_traverse(PyObject *self, visitproc visit, void *arg)
{
    Front *f = (Front *)self;
    Py_VISIT(f->entries); Py_VISIT(f->tensor_type); Py_VISIT(f->rop_type);
    Py_VISIT(f->plan_type); Py_VISIT(f->world_globals); Py_VISIT(f->thread_worlds);
    Py_VISIT(f->profiling_globals); Py_VISIT(f->capture);
    return 0;
}

static int
front_clear(PyObject *self)
{
    Front *f = (Front *)self;
    Py_CLEAR(f->entries); Py_CLEAR(f->tensor_type); Py_CLEAR(f->rop_type);
    Py_CLEAR(f->plan_type); Py_CLEAR(f->world_globals); Py_CLEAR(f->thread_worlds);
    Py_CLEAR(f->profiling_globals); Py_CLEAR(f->capture);
    return 0;
}

CALLABLE_TYPE(Front_Type, "rankwise._hotcall.Front", Front, front,
              "front(tensor, op, group, async_op): all_reduce's checks for a kept view, in C");

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_hotcall",
    "A small device all_reduce's host steps in C (optional; see rankwise.api.collectives).",
    -1,
    NULL,
};

PyMODINIT_FUNC
PyInit__hotcall(void)
{
#define NAME(v, s) if ((v = PyUnicode_InternFromString(s)) == NULL) return NULL
    NAME(s_failed, "failed"); NAME(s_due_at, "due_at"); NAME(s_before, "before");
    NAME(s_enqueued, "enqueued");
    NAME(s_started, "started"); NAME(s_engine, "engine"); NAME(s_appended, "appended");
    NAME(s_pendings, "pendings"); NAME(s_append, "append"); NAME(s_seq, "seq");
    NAME(s_timeout, "timeout"); NAME(s_label, "label"); NAME(s_doing, "doing");
    NAME(s_finished, "finished"); NAME(s_last, "_last");
    NAME(s_since, "since"); NAME(s_tracer, "tracer"); NAME(s_collective, "collective");
    NAME(s_failure, "failure"); NAME(s_title, "title"); NAME(s_error, "error");
    NAME(s_work, "work"); NAME(s_wait, "wait");
    NAME(s_data_ptr, "data_ptr"); NAME(s_shape, "shape"); NAME(s_dtype, "dtype");
    NAME(s_requires_grad, "requires_grad"); NAME(s_is_contiguous, "is_contiguous");
    NAME(s_world, "_world"); NAME(s_default_group, "default_group");
    NAME(s_device_route, "device_route"); NAME(s_queued, "queued");
    NAME(s_recording, "recording"); NAME(s_on, "on");
#undef NAME
    if ((one = PyLong_FromLong(1)) == NULL || (two = PyLong_FromLong(2)) == NULL)
        return NULL;
    if (PyType_Ready(&WorkWait_Type) < 0 || PyType_Ready(&Enqueue_Type) < 0
        || PyType_Ready(&AllReduce_Type) < 0 || PyType_Ready(&Front_Type) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddObjectRef(m, "WorkWait", (PyObject *)&WorkWait_Type) < 0
        || PyModule_AddObjectRef(m, "Enqueue", (PyObject *)&Enqueue_Type) < 0
        || PyModule_AddObjectRef(m, "AllReduce", (PyObject *)&AllReduce_Type) < 0
        || PyModule_AddObjectRef(m, "Front", (PyObject *)&Front_Type) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
